"""The agent endpoint's throughput: concurrent agent programs (threads with the `openai` client), each
playing episodes of a few chat calls against one engine, for each request-batching window.

    .venv/bin/python -m bench.endpoint [--agents 16] [--episodes 4] [--calls 3] [--waits 0,10,50] [--repeats 3]

rollout.endpoint.batch_wait_ms gathers the calls that arrive within the window into one engine call:
with 0, only the calls already queued when the server's loop comes round go together. Prints calls/s
and the median and p90 latency of a call per window, then a final JSON line. Every episode is
checked to come back whole. Uses relay's tiny addition policy (built once under runs/models).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import ray

from orchestrator.data.builtin_models import resolve_model_path
from rollout.config import EndpointConfig, RolloutConfig, SamplingConfig
from rollout.gateway import Gateway
from rollout.pool import RolloutPool

REPO = Path(__file__).resolve().parents[1]


def agent(url: str, name: str, episodes: int, calls: int, latencies: list) -> None:
    import httpx
    from openai import OpenAI

    for e in range(episodes):
        client = OpenAI(base_url=f"{url}/episodes/{name}-{e}/v1", api_key="unused")
        messages = [{"role": "user", "content": f"{10 + e}+{20 + e}="}]
        for _ in range(calls):
            start = time.perf_counter()
            reply = client.chat.completions.create(model="relay-policy", messages=messages, max_tokens=8)
            latencies.append(time.perf_counter() - start)
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content},
                {"role": "user", "content": "check"},
            ]
        httpx.post(f"{url}/episodes/{name}-{e}/reward", json={"reward": 1.0}).raise_for_status()


def run(pool, model: str, wait_ms: float, agents: int, episodes: int, calls: int) -> dict:
    cfg = EndpointConfig(enabled=True, port=0, batch_wait_ms=wait_ms)
    gateway = ray.remote(num_cpus=0)(Gateway).remote(pool.workers, model, cfg, SamplingConfig(), 64)
    url, latencies = ray.get(gateway.url.remote()), []
    threads = [threading.Thread(target=agent, args=(url, f"a{i}", episodes, calls, latencies)) for i in range(agents)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    batch, n_episodes, _ = ray.get(gateway.take.remote(agents * episodes, 10.0))
    ray.get(gateway.shutdown.remote())
    ray.kill(gateway)
    assert n_episodes == agents * episodes and sum(batch.turns) == agents * episodes * calls
    lat = sorted(latencies)
    return {
        "wait_ms": wait_ms,
        "calls_per_s": len(lat) / wall,
        "latency_p50_s": statistics.median(lat),
        "latency_p90_s": lat[int(0.9 * (len(lat) - 1))],
        "wall_s": wall,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--agents", type=int, default=16)
    p.add_argument("--episodes", type=int, default=4)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--waits", default="0,10,50")
    p.add_argument("--repeats", type=int, default=3, help="rounds over the windows, interleaved; medians reported")
    args = p.parse_args()
    model = resolve_model_path("builtin://tiny-addition-gpt", str(REPO / "runs"))
    ray.init(include_dashboard=False, log_to_driver=False)
    pool = RolloutPool(
        RolloutConfig(max_model_len=64, max_prompt_tokens=48, sampling=SamplingConfig(max_new_tokens=8)),
        model,
        1,
        seed=0,
    )
    try:
        run(pool, model, 10.0, 2, 1, 2)  # warm-up
        runs = [
            run(pool, model, float(w), args.agents, args.episodes, args.calls)
            for _ in range(args.repeats)
            for w in args.waits.split(",")
        ]
        rows = [
            {k: statistics.median(r[k] for r in runs if r["wait_ms"] == float(w)) for k in runs[0]}
            for w in args.waits.split(",")
        ]
    finally:
        pool.shutdown()
        ray.shutdown()
    print(
        f"{args.agents} agents x {args.episodes} episodes x {args.calls} calls, one engine; medians of {args.repeats}"
    )
    print(f"{'batch_wait_ms':>13} {'calls/s':>8} {'p50 s':>7} {'p90 s':>7} {'wall s':>7}")
    for r in rows:
        print(
            f"{r['wait_ms']:>13.0f} {r['calls_per_s']:>8.1f} {r['latency_p50_s']:>7.3f} {r['latency_p90_s']:>7.3f} "
            f"{r['wall_s']:>7.1f}"
        )
    print(json.dumps({"agents": args.agents, "episodes": args.episodes, "calls": args.calls, "rows": rows}))


if __name__ == "__main__":
    main()

"""Rollout throughput against bare vLLM, and weight-sync time against a raw broadcast.

    .venv/bin/python -m bench.rollout [--prompts 64] [--n 4] [--new-tokens 32] [--repeats 3]

1. Generation: the RolloutPool (1 worker: a RolloutWorker actor, prompt encoding, per-request seeds,
   logprobs, the RolloutBatch, the CPU plain-linear fix) against a bare `vllm.LLM` in an actor of
   the same process layout and threads, same model, prompts and sampling; repeats interleaved,
   medians compared. Also a 2-worker pool.
2. Weight sync: pool.receive_weights + send_weights (bucketed broadcast, loaded into the engines)
   for models of ~1M, ~10M and ~100M parameters, against a raw gloo broadcast of the same bytes as
   one flat tensor to the same number of receivers, into a fresh tensor per receive
   (`"sync_ratio"`), and against the floor: into a buffer allocated once (`"floor_ratio"`). Two
   layouts: Llama (what Qwen, Llama and SmolLM2 share; its `"sync_ratio"` is the headline) and
   GPT-2, whose Conv1D weights the engines store transposed (after the first sync, which finds
   that out, the sender transposes them, as the trainer does). The first two syncs are not timed.
3. Start-up: seconds to a ready 1-worker pool with `enforce_eager` true and false (compiled: the
   first start fills torch.compile's cache), and the tokens/s each then generates.
Prints a table and a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import ray
import torch

from learner.tiny_gpt import init_tiny_gpt, init_tiny_llama
from rollout.config import RolloutConfig, SamplingConfig
from rollout.engine import engine_env
from rollout.pool import PoolOptions, RolloutPool
from rollout.weight_sync import SyncGroup, plan_buckets, send_weights, tensor_metas
from runtime.ports import free_port
from runtime.seeds import request_seed

ARCHS = {"llama": init_tiny_llama, "gpt2": init_tiny_gpt}
SIZES = {
    "1M": dict(n_embd=128, n_layer=4, n_head=4),
    "10M": dict(n_embd=384, n_layer=5, n_head=6),
    "100M": dict(n_embd=768, n_layer=14, n_head=12),
}


class BareVLLM:
    """A plain vllm.LLM as a user would start it, in its own process."""

    def __init__(self, model: str, max_model_len: int):
        from vllm import LLM

        self.llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=max_model_len, seed=0)

    def generate(self, prompt_ids, n: int, max_tokens: int, seeds: list[int]) -> tuple[int, int, float]:
        from vllm import SamplingParams

        # the pool's per-request seeds, so both engines sample the same tokens and lengths
        params = [SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, logprobs=0, seed=s) for s in seeds]
        start = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        return sum(len(c.token_ids) for o in outs for c in o.outputs), sum(len(o.outputs) for o in outs), elapsed


class RawReceiver:
    """A raw broadcast of the sync's bytes as one tensor, loading nothing. fresh: into a new tensor
    each time, as `dist.broadcast(torch.empty(...))` code does (the "raw broadcast"); otherwise into
    one buffer allocated once, which skips the page faults (the "floor")."""

    def join(self, host: str, port: int, rank: int, world: int, numel: int) -> None:
        self.group = SyncGroup(host, port, rank, world, "gloo")
        self.buffer = torch.zeros(numel)

    def receive(self, fresh: bool) -> None:
        self.group.broadcast(torch.empty_like(self.buffer) if fresh else self.buffer)


def make_prompts(n: int, seed: int = 0) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randint(10, 99, (2, n), generator=g)
    return [f"{x}+{y}=" for x, y in zip(a.tolist(), b.tolist())]


def bench_generation(model: str, args) -> dict:
    cfg = RolloutConfig(
        max_model_len=128,
        max_prompt_tokens=16,
        cpu_plain_linear=not args.packed_linear,
        sampling=SamplingConfig(n_samples_per_prompt=args.n, max_new_tokens=args.new_tokens, temperature=1.0),
    )
    prompts = make_prompts(args.prompts)
    pool = RolloutPool(cfg, model, num_workers=1, seed=0)
    # same process layout and threads as a RolloutWorker (engine core in the actor's process), but
    # plain vLLM: no relay code, no plain-linear CPU fix
    env = engine_env(cfg, threads=2, gpu=False)
    bare = ray.remote(BareVLLM).options(num_cpus=1, runtime_env={"env_vars": env}).remote(model, 128)
    tokenizer_ids = ray.get(pool.workers[0].generate.remote(prompts, 0, 0)).prompt_ids[:: args.n]
    pool_times, bare_times, pool_tokens, bare_tokens = [], [], 0, 0
    for rep in range(args.repeats + 1):  # the first round warms both up and is not counted
        start = time.perf_counter()
        batch = pool.generate(prompts, step=rep)
        t_pool = time.perf_counter() - start
        seeds = [request_seed(0, rep, i) for i in range(len(prompts))]  # the pool's run seed, 0
        tokens, completions, t_bare = ray.get(bare.generate.remote(tokenizer_ids, args.n, args.new_tokens, seeds))
        if rep:
            pool_times.append(t_pool), bare_times.append(t_bare)
            pool_tokens, bare_tokens = sum(batch.response_lengths), tokens
    ray.kill(bare)
    pool.shutdown()
    pool2 = RolloutPool(cfg, model, num_workers=2, seed=0)
    pool2.generate(prompts, step=0)
    two_times, two_tokens = [], 0
    for rep in range(args.repeats):
        start = time.perf_counter()
        b2 = pool2.generate(prompts, step=rep + 1)
        two_times.append(time.perf_counter() - start)
        two_tokens = sum(b2.response_lengths)
    pool2.shutdown()
    completions = args.prompts * args.n
    res = {
        "tokens_per_s": pool_tokens / statistics.median(pool_times),
        "bare_vllm_tokens_per_s": bare_tokens / statistics.median(bare_times),
        "completions_per_s": completions / statistics.median(pool_times),
        "bare_vllm_completions_per_s": completions / statistics.median(bare_times),
        "two_worker_tokens_per_s": two_tokens / statistics.median(two_times),
    }
    res["ratio"] = res["tokens_per_s"] / res["bare_vllm_tokens_per_s"]
    return res


def bench_startup(model: str, args) -> dict:
    res = {}
    for mode, eager in (("eager", True), ("compiled", False)):
        cfg = RolloutConfig(
            max_model_len=128,
            max_prompt_tokens=16,
            enforce_eager=eager,
            sampling=SamplingConfig(n_samples_per_prompt=args.n, max_new_tokens=args.new_tokens),
        )
        start = time.perf_counter()
        pool = RolloutPool(cfg, model, num_workers=1, seed=0)
        res[f"{mode}_startup_s"] = time.perf_counter() - start
        prompts = make_prompts(args.prompts)
        pool.generate(prompts, step=0)  # warm-up
        times, tokens = [], 0
        for rep in range(args.repeats):
            start = time.perf_counter()
            tokens = sum(pool.generate(prompts, step=rep + 1).response_lengths)
            times.append(time.perf_counter() - start)
        res[f"{mode}_tokens_per_s"] = tokens / statistics.median(times)
        pool.shutdown()
    return res


def bench_sync(root: Path, arch: str, size: str, workers: int, repeats: int, bucket_mb: int) -> dict:
    model = str(ARCHS[arch](root / f"{arch}-{size}", n_positions=128, **SIZES[size]))
    state = _state(model)
    params = sum(t.numel() for k, t in state.items() if k != "lm_head.weight")
    cfg = RolloutConfig(max_model_len=128, max_prompt_tokens=16, sync_bucket_mb=bucket_mb)
    pool = RolloutPool(cfg, model, num_workers=workers, seed=0, options=PoolOptions(num_cpus=0.5))
    buckets = plan_buckets(tensor_metas(state.items()), cfg.sync_bucket_mb << 20)
    port = free_port()
    joined = pool.init_weight_sync("127.0.0.1", port)
    group = SyncGroup("127.0.0.1", port, 0, pool.sync_world_size, "gloo")
    ray.get(joined)
    receivers = [ray.remote(RawReceiver).options(num_cpus=0).remote() for _ in range(workers)]
    raw_port = free_port()
    numel = sum(m.numel for b in buckets for m in b)
    joined = [r.join.remote("127.0.0.1", raw_port, i + 1, workers + 1, numel) for i, r in enumerate(receivers)]
    raw_group = SyncGroup("127.0.0.1", raw_port, 0, workers + 1, "gloo")
    ray.get(joined)
    flat = torch.randn(numel)
    sync_t, raw_t, floor_t = [], [], []

    def raw(fresh: bool) -> float:
        start = time.perf_counter()
        futs = [r.receive.remote(fresh) for r in receivers]
        raw_group.broadcast(flat)
        ray.get(futs)
        return time.perf_counter() - start

    for i in range(repeats + 2):  # as the trainer does: the first sync finds the engines' layouts
        start = time.perf_counter()
        futs = pool.receive_weights(buckets)
        send_weights(group, buckets, state.__getitem__)
        ray.get(futs)
        sync_t.append(time.perf_counter() - start)
        if i == 0:
            buckets = pool.wire_plan(buckets)
        raw_t.append(raw(fresh=True))
        floor_t.append(raw(fresh=False))
    inproc_t = []  # the in-process path: tensors through Ray's object store, no process group
    for _ in range(min(repeats, 5) + 2):
        start = time.perf_counter()
        pool.load_weights(list(state.items()))
        inproc_t.append(time.perf_counter() - start)
    pool.shutdown()
    for r in receivers:
        ray.kill(r)
    sync_s, raw_s, floor_s, inproc_s = (statistics.median(t[2:]) for t in (sync_t, raw_t, floor_t, inproc_t))
    return {
        "params": params,
        "mbytes": numel * 4 / 2**20,
        "sync_s": sync_s,
        "raw_broadcast_s": raw_s,
        "floor_s": floor_s,
        "in_process_s": inproc_s,
        "sync_ratio": sync_s / raw_s,
        "floor_ratio": sync_s / floor_s,
    }


def _state(model: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).state_dict()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sync-workers", type=int, default=2)
    p.add_argument("--sync-repeats", type=int, default=15, help="syncs are short and noisy: more repeats")
    p.add_argument("--gen-size", default="10M", choices=list(SIZES))
    p.add_argument("--packed-linear", action="store_true", help="pool without the CPU plain-linear fix")
    p.add_argument("--skip-sync", action="store_true")
    p.add_argument("--skip-gen", action="store_true")
    p.add_argument("--skip-startup", action="store_true")
    p.add_argument("--bucket-mb", type=int, default=RolloutConfig.sync_bucket_mb)
    args = p.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        gen_model = str(init_tiny_gpt(root / "gen", n_positions=128, **SIZES[args.gen_size]))
        gen = {} if args.skip_gen else bench_generation(gen_model, args)
        if gen:
            print(
                f"generation ({args.gen_size} GPT-2, {args.prompts} prompts x {args.n} x <= {args.new_tokens} tokens): "
                f"pool {gen['tokens_per_s']:.0f} tok/s, bare vLLM {gen['bare_vllm_tokens_per_s']:.0f} tok/s, "
                f"ratio {gen['ratio']:.3f}; 2 workers {gen['two_worker_tokens_per_s']:.0f} tok/s"
            )
        startup = {} if args.skip_startup else bench_startup(gen_model, args)
        if startup:
            print(
                f"start-up: eager {startup['eager_startup_s']:.1f} s then {startup['eager_tokens_per_s']:.0f} tok/s; "
                f"compiled {startup['compiled_startup_s']:.1f} s then {startup['compiled_tokens_per_s']:.0f} tok/s"
            )
        sync = {}
        for arch, size in [] if args.skip_sync else [(a, s) for a in ARCHS for s in SIZES]:
            s = sync[f"{arch}-{size}"] = bench_sync(
                root, arch, size, args.sync_workers, args.sync_repeats, args.bucket_mb
            )
            print(
                f"sync {arch:>5} {size:>4} ({s['params'] / 1e6:6.1f}M params, {s['mbytes']:6.1f} MiB) "
                f"to {args.sync_workers} workers: "
                f"{s['sync_s'] * 1e3:8.1f} ms vs raw broadcast {s['raw_broadcast_s'] * 1e3:8.1f} ms, "
                f"ratio {s['sync_ratio']:.2f}; floor {s['floor_s'] * 1e3:8.1f} ms, ratio {s['floor_ratio']:.2f}; "
                f"in-process {s['in_process_s'] * 1e3:7.1f} ms"
            )
    ray.shutdown()
    out = {k: round(v, 3) for k, v in gen.items() | startup.items()}
    out["sync"] = {k: {kk: round(vv, 4) for kk, vv in v.items()} for k, v in sync.items()}
    for arch in ARCHS if sync else []:
        for ratio in ("sync_ratio", "floor_ratio"):  # the worst size; Llama's is the headline
            key = ratio if arch == "llama" else f"{ratio}_{arch}"
            out[key] = round(max(v[ratio] for k, v in sync.items() if k.startswith(arch)), 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

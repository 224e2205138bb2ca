"""What asynchronous training buys on a 64-GPU cluster, by simulation (no GPU needed; issue 17).

    .venv/bin/python -m bench.async_sim [--generate 3.61 --score 2.33 --update 9.95 --sync 0.18] [--tail 0.3]

The inputs are one synchronous step's phases, in seconds, as bench/e2e.py measures them (defaults:
relay on the SmolLM2 bf16 preset, docs/benchmarks.md). The model, stated so it can be argued with:
- Work scales ideally with the devices a phase gets: on a share f of the cluster it takes
  (seconds / f). The synchronous loop (colocated, verl's hybrid engine) gives every phase the whole
  cluster in turn; the asynchronous modes split it, a share r for the engines and the scoring service
  (relay judges each batch behind its generation, while the engines would wait) and 1 - r for the
  learner. Each mode gets its best r (a grid of 1/16ths).
- Except generation's tail: a batch ends with its longest response, whose tokens are decoded one
  after another however many devices wait. A share `tail` of the generate time is this latency (it
  does not shrink with devices; the devices idle through it), the rest is throughput. Batch k's
  generate time is also multiplied by a lognormal factor of mean 1 and sigma `spread`.
- A weight sync costs `sync` seconds on the engines' side, paid when they take a new version; the
  learner's side of an async sync is a staged copy, counted as 5% of it.
- The engines start batch k only once they hold policy version >= k - N (N = 0 sync, 1 one_step,
  max_staleness for full): AReaL's and relay's admission rule. The learner trains batches in order.
- Engines that run one generate call (one batch) at a time make each batch pay its own tail (relay
  before its AsyncLLM engines, issue 28). The last rows are engines that start the next batch's
  requests in the slots the tail frees (continuous batching across batches: relay's AsyncLLM engines
  in full and in_flight, AReaL, PipelineRL); in_flight also takes each sync without draining them.
The same discrete-event loop runs every mode for 400 batches, 5 seeds; it prints seconds per step and
the speed-up over sync for this input and for a long-reasoning workload where generation dominates.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics

STEPS, SEEDS, GRID = 400, 5, [i / 16 for i in range(1, 16)]
MODES = [
    ("sync", 0, False),
    ("one_step", 1, False),
    ("full, staleness 1", 1, False),
    ("full, staleness 2", 2, False),
    ("full, staleness 4", 4, False),
    ("full, staleness 1, batches overlap in the engines", 1, True),
    ("full or in_flight, staleness 2, batches overlap in the engines", 2, True),
]


def tail_factors(n: int, tail: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [math.exp(tail * rng.gauss(0, 1) - tail * tail / 2) for _ in range(n)]


def simulate(
    g: float, s: float, u: float, y: float, lead: int, r: float, factors: list[float], tail: float, across: bool = False
) -> float:
    """Seconds per step, steady state, of `lead` (0 = the synchronous colocated loop) with a share r
    of the cluster for the engines; across: the engines fill the tail with the next batch's requests."""

    def generate(f: float) -> float:  # one batch on the engines' share, then its scoring
        return g * f * ((1 - tail) / r + (0.0 if across else tail)) + s / r

    if lead == 0:
        return statistics.fmean(g * f + s + u + y for f in factors)
    stage = 0.05 * y
    learner_free, rollout_free, held = 0.0, 0.0, 0  # held: the version the engines hold
    synced = [0.0]  # synced[v]: when the learner has staged version v (v = updates done)
    ready, finished = [], []

    def train(j: int) -> None:
        nonlocal learner_free
        learner_free = max(learner_free, ready[j]) + u / (1 - r) + stage
        synced.append(learner_free)
        finished.append(learner_free)

    for k, f in enumerate(factors):
        need = max(0, k - lead)  # batch k comes from a policy at most `lead` versions older than k's learner
        while len(synced) <= need:
            train(len(synced) - 1)
        start = max(rollout_free, synced[need])
        newest = max(v for v in range(len(synced)) if synced[v] <= start)
        if newest > held:  # take the newest weights before this batch
            start, held = start + y, newest
        rollout_free = start + generate(f)
        ready.append(rollout_free)
    while len(finished) < len(factors):
        train(len(finished))
    half = len(finished) // 2  # steady state: the second half
    return (finished[-1] - finished[half]) / (len(finished) - 1 - half)


def best(g, s, u, y, lead, spread, tail, across=False) -> tuple[float, float]:
    """(seconds per step, the engines' share) at the best share, mean over seeds."""
    runs = {
        r: statistics.fmean(
            simulate(g, s, u, y, lead, r, tail_factors(STEPS, spread, seed), tail, across) for seed in range(SEEDS)
        )
        for r in ([1.0] if lead == 0 else GRID)
    }
    r = min(runs, key=runs.get)
    return runs[r], r


def table(name: str, g, s, u, y, spread, tail) -> None:
    total = g + s + u + y
    print(
        f"\n{name}: generate {g / total:.0%} (tail {tail:.0%} of it), score {s / total:.0%}, update {u / total:.0%}, "
        f"sync {y / total:.1%} of a sync step; spread {spread}"
    )
    print("| mode | engines' share of the cluster | step (x sync) | speed-up |\n|---|---|---|---|")
    base = best(g, s, u, y, 0, spread, tail)[0]
    for mode, lead, across in MODES:
        t, r = best(g, s, u, y, lead, spread, tail, across)
        print(f"| {mode} | {'all, in turn' if lead == 0 else f'{r:.0%}'} | {t / base:.3f} | {base / t:.2f}x |")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--generate", type=float, default=3.60)
    p.add_argument("--score", type=float, default=1.95)
    p.add_argument("--update", type=float, default=7.29)
    p.add_argument("--sync", type=float, default=0.156)
    p.add_argument(
        "--tail", type=float, default=0.3, help="share of generate time spent on the longest responses alone"
    )
    p.add_argument("--spread", type=float, default=0.3, help="lognormal sigma of a batch's generate time")
    p.add_argument("--label", default="measured phases (relay, SmolLM2 bf16 on CPU)", help="the input's name")
    a = p.parse_args()
    table(a.label, a.generate, a.score, a.update, a.sync, a.spread, a.tail)
    # long chain-of-thought RL on GPUs: generation most of the step and much of it the tail (as
    # verl's, AReaL's and slime's reports describe it); assumed shares, not a measurement
    table("long reasoning (assumed shares)", 70.0, 5.0, 22.0, 3.0, 0.5, 0.5)


if __name__ == "__main__":
    main()

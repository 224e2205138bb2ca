"""The sync check's gap and cost (rollout/sync_check.py; docs/benchmarks.md "Sync check"): a real learner rank and
a real engine; per update, the probe's largest logprob gap between engine and learner before the sync (the
engine one update stale: what a lost sync looks like) and after it (what a sync that arrived looks like), the
time of the check (the learner's probe forward and the engine's) and the time of the sync it checks.

    python -m bench.sync_check ROOT [--models builtin://tiny-addition-gpt builtin://smollm2-135m-instruct]
                                    [--dtypes float32 bfloat16] [--syncs 5]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

import ray


def measure(root: Path, model: str, dtype: str, syncs: int) -> dict:
    from learner.config import AlgorithmConfig, Dtype, Estimator, LearnerConfig
    from learner.group import LearnerGroup, RankPlacement
    from orchestrator.data.builtin_models import resolve_model_path
    from rollout.channel import WeightChannel
    from rollout.config import RolloutConfig, SamplingConfig
    from rollout.pool import PoolOptions, RolloutPool
    from rollout.sync_check import TOLERANCE, SyncCheck
    from runtime.logprobs import SamplerSettings
    from tests.helpers import make_scored_batch

    path = resolve_model_path(model, str(root))
    cfg = RolloutConfig(dtype=dtype, max_model_len=64, max_prompt_tokens=16, sampling=SamplingConfig(max_new_tokens=8))
    pool = RolloutPool(cfg, path, num_workers=1, seed=0, options=PoolOptions(num_cpus=0))
    learner = LearnerGroup(
        LearnerConfig(model_path=path, lr=1e-4, dtype=Dtype(dtype)),  # bf16: precision auto = autocast, as on CPUs
        AlgorithmConfig(estimator=Estimator.grpo, mini_batch_size=8, micro_batch_size=4),
        SamplerSettings(n_samples_per_prompt=4),
        1,
        seed=0,
        placement=RankPlacement(num_cpus=0),
    )
    try:
        check = SyncCheck(f"full weights, {dtype}", math.inf)  # measured here, not judged: the gaps themselves
        channel = WeightChannel(pool, learner, bucket_mb=16, timeout_s=600, check=check)
        gaps, stale, check_s, sync_s = [], [], [], []
        for version in range(1, syncs + 1):
            learner.update(*make_scored_batch(path, seed=version), step=version)
            channel.verify(version)  # the engines still hold the version before: one update stale
            stale.append(channel.probe_gap)
            sync, checked = sync_then_check(channel, check, version)
            sync_s.append(sync), check_s.append(checked), gaps.append(channel.probe_gap)
        return {
            "model": model,
            "dtype": dtype,
            "probe tokens": len(channel.probe),
            "largest gap after a sync": max(gaps),
            "smallest gap one update stale": min(stale),
            "tolerance": TOLERANCE[dtype],
            "check ms (median)": 1000 * statistics.median(check_s),
            "sync ms (median)": 1000 * statistics.median(sync_s),
        }
    finally:
        learner.shutdown()
        pool.shutdown()


def sync_then_check(channel, check, version: int) -> tuple[float, float]:
    """One sync timed alone (its check off), then its check timed alone: (sync s, check s); the gap is the
    channel's probe_gap."""
    channel.sync_check = None
    began = time.perf_counter()
    channel.send(version)
    sync = time.perf_counter() - began
    channel.sync_check = check
    began = time.perf_counter()
    channel.verify(version)
    return sync, time.perf_counter() - began


def print_rows(rows: list[dict]) -> None:
    """`rows` as a markdown table, floats to 3 significant digits."""
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |\n" + "|---" * len(keys) + "|")
    for r in rows:
        print("| " + " | ".join(f"{r[k]:.3g}" if isinstance(r[k], float) else str(r[k]) for k in keys) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("root", type=Path)
    p.add_argument("--models", nargs="+", default=["builtin://tiny-addition-gpt", "builtin://smollm2-135m-instruct"])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--syncs", type=int, default=5)
    a = p.parse_args()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    print_rows([measure(a.root, m, d, a.syncs) for m in a.models for d in a.dtypes])


if __name__ == "__main__":
    main()

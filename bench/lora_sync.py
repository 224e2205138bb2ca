"""LoRA weight sync, the adapter alone against the merged model (learner.lora.sync; docs/benchmarks.md "LoRA
sync"): a real learner rank with LoRA and a real engine, per path the bytes one sync carries, its time (median
over syncs, each after an update, the sync check off while timed) and the sync check's gap after it.

    python -m bench.lora_sync ROOT [--model builtin://smollm2-135m-instruct] [--rank 16] [--syncs 5]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import ray

from bench.sync_check import print_rows, sync_then_check

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]  # learner.lora.target_modules' default


def measure(path: str, sync: str, rank: int, syncs: int) -> dict:
    from learner.lora_config import LoraConfig, LoraSync
    from rollout.channel import WeightChannel
    from rollout.config import RolloutConfig, SamplingConfig
    from rollout.pool import PoolOptions, RolloutPool
    from rollout.sync_check import TOLERANCE, SyncCheck
    from tests.helpers import make_scored_batch, tiny_learner

    cfg = RolloutConfig(max_model_len=64, max_prompt_tokens=16, sampling=SamplingConfig(max_new_tokens=8))
    options = PoolOptions(num_cpus=0, lora_rank=rank if sync == "adapter" else 0)
    pool = RolloutPool(cfg, path, num_workers=1, seed=0, options=options)
    lora = LoraConfig(rank=rank, alpha=2 * rank, target_modules=TARGETS, sync=LoraSync(sync))
    learner = tiny_learner(path, lr=1e-3, lora=lora)
    try:
        check = SyncCheck(f"{sync}, float32", TOLERANCE["float32"])
        channel = WeightChannel(pool, learner, bucket_mb=16, timeout_s=600, check=check)
        times, gaps = [], []
        for version in range(1, syncs + 1):
            learner.update(*make_scored_batch(path, seed=version), step=version)
            times.append(sync_then_check(channel, check, version)[0])
            gaps.append(channel.probe_gap)
        return {
            "path": sync,
            "MB a sync": channel.sent_bytes / 1e6,
            "sync ms (median)": 1000 * statistics.median(times),
            "largest probe gap": max(gaps),
        }
    finally:
        learner.shutdown()
        pool.shutdown()


def main() -> None:
    from orchestrator.data.builtin_models import resolve_model_path

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("root", type=Path)
    p.add_argument("--model", default="builtin://smollm2-135m-instruct")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--syncs", type=int, default=5)
    a = p.parse_args()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    path = resolve_model_path(a.model, str(a.root))
    rows = [measure(path, sync, a.rank, a.syncs) for sync in ("adapter", "merged")]
    print(f"{a.model}, LoRA rank {a.rank} on {', '.join(TARGETS)}, {a.syncs} syncs each")
    print_rows(rows)
    print(
        f"adapter / merged: {rows[0]['MB a sync'] / rows[1]['MB a sync']:.4f} of the bytes, "
        f"{rows[0]['sync ms (median)'] / rows[1]['sync ms (median)']:.3f} of the time"
    )


if __name__ == "__main__":
    main()

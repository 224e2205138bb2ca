"""Learner training throughput and model-FLOPs utilisation, for 1 and 2 ranks at ZeRO 0 and 2.

    .venv/bin/python -m bench.learner [--samples 64] [--repeats 3]

A GRPO update (recompute old logprobs, then one epoch of mini-batches 32 / micro-batches 8) on a
9.0M-parameter GPT-2 (the bench/rollout.py "10M" shape), 16 prompt + 32 response tokens per sample,
float32, torch AdamW through DeepSpeed on the CPU. Tokens are all sequence tokens of the batch.
MFU = 6 * N * tokens / time / peak, where peak is this machine's measured float32 matmul rate
(the experience forward adds another 2 * N * tokens, so the true utilisation is 4/3 of that).
Prints a table and a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import ray
import torch

from learner.config import AlgorithmConfig, Estimator, LearnerConfig
from learner.group import LearnerGroup, RankPlacement
from learner.tiny_gpt import init_tiny_gpt
from reward_service.types import ScoredBatch
from rollout.types import RolloutBatch
from runtime.logprobs import SamplerSettings

SHAPE = dict(n_embd=384, n_layer=5, n_head=6)


def matmul_peak_flops(n: int = 2048, repeats: int = 5) -> float:
    torch.set_num_threads(os.cpu_count() or 1)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * n**3 / min(times)


def make_batch(samples: int, group: int = 8) -> tuple[RolloutBatch, ScoredBatch]:
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 60, (samples // group, 16), generator=g).tolist()
    P = [p for p in prompts for _ in range(group)]
    R = torch.randint(3, 60, (samples, 32), generator=g).tolist()
    batch = RolloutBatch(
        [i // group for i in range(samples)], P, R, [[-4.0] * 32] * samples, ["x"] * samples, ["length"] * samples
    )
    rewards = torch.rand(samples, generator=g).tolist()
    scored = ScoredBatch(rewards, {}, [True] * samples, [False] * samples, [[-4.0] * 32] * samples, raw=rewards)
    return batch, scored


def bench(model: str, world: int, zero: int, batch, scored, repeats: int) -> float:
    algo = AlgorithmConfig(estimator=Estimator.grpo, mini_batch_size=32, micro_batch_size=8, ppo_epochs=1)
    threads = max(1, (os.cpu_count() or 1) // world)
    group = LearnerGroup(
        LearnerConfig(model_path=model, lr=1e-5, zero_stage=zero),
        algo,
        SamplerSettings(n_samples_per_prompt=8),
        world,
        seed=0,
        placement=RankPlacement(num_cpus=0, threads=threads),
    )
    try:
        group.update(batch, scored, step=0)
        times = []
        for step in range(repeats):
            start = time.perf_counter()
            group.update(batch, scored, step=step + 1)
            times.append(time.perf_counter() - start)
    finally:
        group.shutdown()
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    peak = matmul_peak_flops()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    batch, scored = make_batch(args.samples)
    tokens = sum(len(x) + len(y) for x, y in zip(batch.prompt_ids, batch.response_ids))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = str(init_tiny_gpt(Path(tmp) / "gpt", n_positions=128, **SHAPE))
        from transformers import AutoModelForCausalLM

        n_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model).parameters())
        for world in (1, 2):
            for zero in (0, 2):
                seconds = bench(model, world, zero, batch, scored, args.repeats)
                tps = tokens / seconds
                results[f"ranks{world}_zero{zero}"] = {
                    "seconds": round(seconds, 3),
                    "tokens_per_s": round(tps, 1),
                    "mfu": round(6 * n_params * tps / peak, 4),
                }
                print(
                    f"{world} rank(s), ZeRO {zero}: {seconds:.3f} s/update, {tps:8.0f} tokens/s, "
                    f"MFU {6 * n_params * tps / peak:.1%}"
                )
    ray.shutdown()
    print(
        json.dumps(
            {"params": n_params, "tokens_per_update": tokens, "matmul_peak_gflops": round(peak / 1e9, 1), **results}
        )
    )


if __name__ == "__main__":
    main()

"""SFT and reward-model training throughput on the learner ranks (relay sft / relay rm).

    .venv/bin/python -m bench.stages [--steps 20] [--repeats 3]

The 9.0M-parameter GPT-2 of bench/learner.py (character tokenizer), float32, torch AdamW through
DeepSpeed on the CPU, mini-batches of 64 (SFT sequences, or RM pairs: two sequences each) in
micro-batches of 32, on 1 rank (ZeRO 0) and 2 ranks (ZeRO 2). Data: generated 3-digit addition
demonstrations and preference pairs. Tokens are all non-pad sequence tokens of a mini-batch.
MFU against this machine's measured float32 matmul peak, 6 * N * tokens per step.
Prints a table and a final JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import ray

from bench.learner import SHAPE, matmul_peak_flops
from learner.supervised import RM, SFT, SupervisedGroup
from learner.tiny_gpt import init_tiny_gpt
from orchestrator.config.schema import StageConfig
from orchestrator.data.generate import demonstrations, preferences
from orchestrator.data.tasks import make_task
from orchestrator.stages.supervised import encode_rm, encode_sft


def bench(model: str, kind: str, world: int, zero: int, steps: int, repeats: int) -> dict:
    from transformers import AutoTokenizer

    cfg = StageConfig()
    cfg.learner = dataclasses.replace(cfg.learner, model_path=model, zero_stage=zero, lr=1e-4)
    cfg.train = dataclasses.replace(cfg.train, batch_size=64, micro_batch_size=32 // world, max_length=64)
    tok = AutoTokenizer.from_pretrained(model)
    examples = make_task("addition_3digit", 64 * steps, seed=0)
    rows = demonstrations(examples) if kind == SFT else preferences(examples, seed=0)
    batch, _ = (encode_sft if kind == SFT else encode_rm)(tok, rows, cfg)
    group = SupervisedGroup(cfg.learner, cfg.train, kind, world, seed=0)
    masks = [k for k in batch if k.endswith(("attention_mask", "attention"))]
    per_step, tokens = [], 0
    for rep in range(repeats + 1):  # round 0 warms up
        start = time.perf_counter()
        for i in range(steps):
            group.train_step({k: v[i * 64 : (i + 1) * 64] for k, v in batch.items()})
        if rep:
            per_step.append((time.perf_counter() - start) / steps)
    tokens = sum(int(batch[m][: 64 * steps].sum()) for m in masks) / steps
    group.shutdown()
    seconds = statistics.median(per_step)
    return {
        "seconds_per_step": round(seconds, 4),
        "tokens_per_s": round(tokens / seconds, 1),
        "sequences_per_s": round(64 * (1 if kind == SFT else 2) / seconds, 1),
        "tokens_per_step": tokens,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    peak = matmul_peak_flops()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = str(init_tiny_gpt(Path(tmp) / "gpt", n_positions=64, **SHAPE))
        from transformers import AutoModelForCausalLM

        params = sum(t.numel() for t in AutoModelForCausalLM.from_pretrained(model).parameters())
        for kind in (SFT, RM):
            for world, zero in ((1, 0), (2, 2)):
                r = bench(model, kind, world, zero, args.steps, args.repeats)
                r["mfu"] = round(6 * params * r["tokens_per_s"] / peak, 3)
                results[f"{kind}_ranks{world}_zero{zero}"] = r
                print(
                    f"{kind:>3} {world} rank(s) ZeRO {zero}: {r['seconds_per_step']:.3f} s/step, "
                    f"{r['tokens_per_s']:8.0f} tokens/s, {r['sequences_per_s']:6.0f} seq/s, MFU {r['mfu']:.1%}",
                    flush=True,
                )
    ray.shutdown()
    print(json.dumps({"params": params, "peak_gflops": round(peak / 1e9, 1), **results}))


if __name__ == "__main__":
    main()

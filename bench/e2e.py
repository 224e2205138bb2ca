"""Seconds per training step of the default run, by phase, and samples/s.

    .venv/bin/python -m bench.e2e [--steps 12] [key=value ...]

Runs configs/grpo_tiny_cpu.yaml (overrides allowed) through the real stack: 1 vLLM worker, the
scoring service and 1 DeepSpeed rank on this machine. The first 2 steps are warm-up; medians over
the rest. Prints a table and a final JSON line.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from orchestrator.load_config import load_config
from orchestrator.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
PHASES = ("generate", "score", "update", "sync", "total")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(REPO / "configs" / "grpo_tiny_cpu.yaml", [
            f"total_steps={args.steps}", f"run_root={tmp}", "logging.wandb.mode=disabled", "logging.progress_bar=false",
            "learner.model_path=builtin://tiny-addition-gpt", *args.overrides])
        cfg.run_root = tmp
        models = REPO / "runs" / "models"  # reuse the cached starting policy if the default run built it
        if (models / "tiny-addition-gpt").exists():
            cfg.learner.model_path = str(models / "tiny-addition-gpt")
        trainer = Trainer(cfg)
        rows = []
        try:
            trainer.before = {}
            while trainer.step < cfg.total_steps:
                rows.append(trainer.train_step())
                trainer.step += 1
        finally:
            trainer.shutdown()
    timed = rows[2:]
    med = {ph: statistics.median(r[f"timing/{ph}"] for r in timed) for ph in PHASES}
    samples = statistics.median(r["throughput/samples_per_s"] for r in timed)
    tokens = statistics.median(r["throughput/tokens_per_s"] for r in timed)
    for ph in PHASES:
        print(f"{ph:9s} {med[ph]:7.3f} s  ({med[ph] / med['total']:5.1%})")
    per_step = cfg.data.rollout_batch_size * cfg.rollout.sampling.n_samples_per_prompt
    print(f"samples/s {samples:.1f}, response tokens/s {tokens:.1f}, {per_step} samples/step")
    print(json.dumps({"steps_timed": len(timed), **{f"{ph}_s": round(v, 3) for ph, v in med.items()},
                      "samples_per_s": round(samples, 1), "tokens_per_s": round(tokens, 1)}))


if __name__ == "__main__":
    main()

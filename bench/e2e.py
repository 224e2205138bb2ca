"""Relay against the plain single-process GRPO loop (bench/baseline_loop.py), back to back on the
same config and seed: seconds per step by phase, the speed-up, and the held-out greedy accuracy
each reaches (issue 16).

    .venv/bin/python -m bench.e2e [--config configs/grpo_tiny_cpu.yaml] [--steps 12] [--relay-only] [key=value ...]

Relay runs through the real stack (vLLM worker, scoring service, DeepSpeed rank, colocated on this
machine), then shuts down before the baseline starts, so each has every core. The first 2 steps
of each are warm-up; medians over the rest. Phases compared: generate; score (reference logprobs +
reward); update (relay's update plus its weight sync; the baseline's weights are already where it
samples). Prints a table and a final JSON line.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import ray

from bench.baseline_loop import medians, run_baseline
from orchestrator.builtin_models import resolve_model_path
from orchestrator.load_config import load_config
from orchestrator.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
ACCURACY = "eval/greedy/reward/accuracy"


def run_relay(cfg, steps: int) -> dict:
    trainer = Trainer(cfg)
    try:
        before = trainer.evaluate().get(ACCURACY, float("nan"))  # nan with eval.greedy: false
        rows = []
        for _ in range(steps):
            m = trainer.train_step()
            trainer.step += 1
            rows.append({"generate": m["timing/generate"], "score": m["timing/score"], "sync": m["timing/sync"],
                         "update": m["timing/update"] + m["timing/sync"], "total": m["timing/total"],
                         "gap": m["rollout/logprob_gap"]})
        after = trainer.evaluate().get(ACCURACY, float("nan"))
    finally:
        trainer.shutdown()
        ray.shutdown()
    return {"rows": rows, "before": before, "after": after}


def report(cfg_name: str, relay: dict, base: dict | None, dtype: str, warmup: int) -> dict:
    r = medians(relay["rows"], ("generate", "score", "update", "sync", "total"), warmup)
    b = medians(base["rows"], warmup=warmup) if base else {}
    print(f"\n{cfg_name}: median s/step over steps {warmup + 1}-{len(relay['rows'])}, dtype {dtype} (both)")
    print(f"{'phase':10s} {'relay':>8s} {'baseline':>9s} {'speed-up':>9s}")
    for ph in ("generate", "score", "update", "total"):
        if b:
            print(f"{ph:10s} {r[ph]:8.3f} {b[ph]:9.3f} {b[ph] / r[ph]:8.2f}x")
        else:
            print(f"{ph:10s} {r[ph]:8.3f}")
    print(f"(relay's update includes its weight sync, {r['sync']:.3f} s; relay's logprob gap, sampler vs learner: "
          f"{statistics.median(x['gap'] for x in relay['rows']):.2e})")
    print(f"held-out greedy accuracy: relay {relay['before']:.3f} -> {relay['after']:.3f}", end="")
    print(f", baseline {base['before']:.3f} -> {base['after']:.3f}" if base else "")
    out = {"config": cfg_name, "dtype": dtype, **{f"relay_{k}_s": round(v, 3) for k, v in r.items()},
           "relay_accuracy": [relay["before"], relay["after"]]}
    if b:
        out |= {**{f"baseline_{k}_s": round(v, 3) for k, v in b.items()}, "speedup": round(b["total"] / r["total"], 3),
                "baseline_accuracy": [base["before"], base["after"]]}
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default=str(REPO / "configs" / "grpo_tiny_cpu.yaml"))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    p.add_argument("--relay-only", action="store_true", help="skip the baseline loop")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [f"total_steps={args.steps}", f"run_root={tmp}", "logging.wandb.mode=disabled",
                     "logging.progress_bar=false", *args.overrides]
        cfg = load_config(args.config, overrides)
        # a built-in starting policy is built once and cached under runs/models, as `relay train` does
        cfg.learner.model_path = resolve_model_path(cfg.learner.model_path, str(REPO / "runs"))
        relay = run_relay(cfg, args.steps)
        base = None if args.relay_only else run_baseline(cfg, args.steps)
    out = report(Path(args.config).stem, relay, base, cfg.learner.dtype.value, args.warmup)
    print(f"took {time.perf_counter() - start:.0f} s")
    print(json.dumps(out))


if __name__ == "__main__":
    main()

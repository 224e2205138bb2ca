"""Relay against the plain single-process GRPO loop (bench/baseline_loop.py), back to back on the
same config and seed: seconds per step by phase, the speed-up, and the held-out greedy accuracy
each reaches (issue 16).

    .venv/bin/python -m bench.e2e [--config configs/grpo_tiny_cpu.yaml] [--steps 12] [--relay-only] [key=value ...]

With --modes, relay alone runs once per async_training mode and seed instead (issue 17):

    .venv/bin/python -m bench.e2e --modes sync,one_step,full:1,full:2 --seeds 0,1,2 --steps 25 [key=value ...]

and prints steps/s, completions/s, each role's idle share and the held-out accuracy after the same
number of samples (every mode trains on the same prompts, in the same order). In the async modes the
engines and the learner get separate halves of the cores (orchestrator.loop.placement.cpu_threads).

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
from orchestrator.config.load import load_config
from orchestrator.data.builtin_models import resolve_model_path
from orchestrator.loop.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
ACCURACY = "eval/greedy/reward/accuracy"


def run_relay(cfg, steps: int) -> dict:
    trainer = Trainer(cfg)
    try:
        before = trainer.evaluator.evaluate(trainer.step).get(ACCURACY, float("nan"))  # nan with eval.greedy: false
        rows = []
        for _ in range(steps):
            m = trainer.train_step()
            trainer.step += 1
            rows.append(
                {
                    "generate": m["timing/generate"],
                    "score": m["timing/score"] + m["timing/reference"],  # as the baseline's score: rewards + ref
                    "sync": m["timing/sync"],
                    "update": m["timing/advantages"] + m["timing/update"] + m["timing/sync"],
                    "total": m["timing/total"],
                    "gap": m["rollout/logprob_gap"],
                }
            )
        after = trainer.evaluator.evaluate(trainer.step).get(ACCURACY, float("nan"))
    finally:
        trainer.shutdown()
        ray.shutdown()
    return {"rows": rows, "before": before, "after": after}


def run_mode(cfg, steps: int, warmup: int) -> dict:
    """One run of `cfg` with eval before and after; step rates from the wall clock between step
    ends after the warm-up (in async modes a step's own timer misses the overlap)."""
    trainer = Trainer(cfg)
    try:
        before = trainer.evaluator.evaluate(trainer.step)
        ends, rows = [], []
        for _ in range(steps):
            rows.append(trainer.train_step())
            trainer.step += 1
            ends.append(time.perf_counter())
        trainer.roles.finish_sync()
        after = trainer.evaluator.evaluate(trainer.step)
    finally:
        trainer.shutdown()
        ray.shutdown()
    step_s = (ends[-1] - ends[warmup - 1]) / (steps - warmup)
    idle = {
        role: statistics.median(r[f"pipeline/idle/{role}"] for r in rows[warmup:])
        for role in ("rollout", "scoring", "learner")
    }
    phases = {
        k: statistics.median(r[f"timing/{k}"] for r in rows[warmup:]) for k in ("generate", "score", "update", "sync")
    }
    return {
        "steps_per_s": 1 / step_s,
        "completions_per_s": len_samples(cfg) / step_s,
        "idle": idle,
        "phases_s": phases,
        "staleness": statistics.fmean(r["async/staleness_mean"] for r in rows),
        "token_staleness": statistics.fmean(r["async/token_staleness_mean"] for r in rows),
        "accuracy": [before.get(ACCURACY, float("nan")), after.get(ACCURACY, float("nan"))],
        "sampled_reward": after["eval/sampled/reward/mean"],
    }


def len_samples(cfg) -> int:
    return cfg.data.rollout_batch_size * cfg.rollout.sampling.n_samples_per_prompt


def compare_modes(
    config: str, modes: list[str], seeds: list[int], steps: int, warmup: int, overrides: list[str]
) -> dict:
    out = {}
    for seed in seeds:  # modes interleaved, so the machine's drift over the minutes spreads over all of them
        for mode in modes:
            name, _, staleness = mode.partition(":")
            extra = [f"async_training.mode={name}"] + (
                [f"async_training.max_staleness={staleness}"] if staleness else []
            )
            with tempfile.TemporaryDirectory() as tmp:
                cfg = load_config(
                    config,
                    [
                        f"total_steps={steps}",
                        f"run_root={tmp}",
                        "logging.wandb.mode=disabled",
                        "logging.progress_bar=false",
                        f"seed={seed}",
                        *extra,
                        *overrides,
                    ],
                )
                cfg.learner.model_path = resolve_model_path(cfg.learner.model_path, str(REPO / "runs"))
                out[(mode, seed)] = run_mode(cfg, steps, warmup)
            print(mode, seed, json.dumps(out[(mode, seed)]), flush=True)
    ratios = {
        m: statistics.median(out[(m, s)]["steps_per_s"] / out[(modes[0], s)]["steps_per_s"] for s in seeds)
        for m in modes
    }
    print(f"\n{Path(config).stem}: {steps} steps, medians over seeds {seeds} (accuracy: each seed)")
    print(
        "| mode | steps/s | vs first (median of per-seed ratios) | completions/s "
        "| idle rollout / scoring / learner | staleness (sample / token) | held-out greedy acc. after |"
    )
    print("|---|---|---|---|---|---|---|")
    for mode in modes:
        runs = [out[(mode, s)] for s in seeds]
        med = lambda f: statistics.median(f(r) for r in runs)  # noqa: E731
        sps = med(lambda r: r["steps_per_s"])
        idle = " / ".join(f"{med(lambda r: r['idle'][k]):.2f}" for k in ("rollout", "scoring", "learner"))
        acc = ", ".join(f"{r['accuracy'][1]:.3f}" for r in runs)
        print(
            f"| {mode} | {sps:.3f} | {ratios[mode]:.2f}x | {med(lambda r: r['completions_per_s']):.1f} | {idle} | "
            f"{med(lambda r: r['staleness']):.2f} / {med(lambda r: r['token_staleness']):.2f} | {acc} |"
        )
    return {f"{m}/{s}": v for (m, s), v in out.items()}


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
    print(
        f"(relay's update includes its weight sync, {r['sync']:.3f} s; relay's logprob gap, sampler vs learner: "
        f"{statistics.median(x['gap'] for x in relay['rows']):.2e})"
    )
    print(f"held-out greedy accuracy: relay {relay['before']:.3f} -> {relay['after']:.3f}", end="")
    print(f", baseline {base['before']:.3f} -> {base['after']:.3f}" if base else "")
    out = {
        "config": cfg_name,
        "dtype": dtype,
        **{f"relay_{k}_s": round(v, 3) for k, v in r.items()},
        "relay_accuracy": [relay["before"], relay["after"]],
    }
    if b:
        out |= {
            **{f"baseline_{k}_s": round(v, 3) for k, v in b.items()},
            "speedup": round(b["total"] / r["total"], 3),
            "baseline_accuracy": [base["before"], base["after"]],
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default=str(REPO / "configs" / "grpo_tiny_cpu.yaml"))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    p.add_argument("--relay-only", action="store_true", help="skip the baseline loop")
    p.add_argument("--modes", default="", help="compare async_training modes instead, e.g. sync,one_step,full:2")
    p.add_argument("--seeds", default="0", help="with --modes: comma-separated seeds")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    start = time.perf_counter()
    if args.modes:
        out = compare_modes(
            args.config,
            args.modes.split(","),
            [int(s) for s in args.seeds.split(",")],
            args.steps,
            args.warmup,
            args.overrides,
        )
        print(f"took {time.perf_counter() - start:.0f} s")
        print(json.dumps(out))
        return
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [
            f"total_steps={args.steps}",
            f"run_root={tmp}",
            "logging.wandb.mode=disabled",
            "logging.progress_bar=false",
            *args.overrides,
        ]
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

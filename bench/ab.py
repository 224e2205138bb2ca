"""One config key's two values on a real preset, A against B: the same `relay train` with KEY=A and KEY=B,
alternating which runs first, then one table (docs/benchmarks.md: "Packing", "bf16 precision").

    python -m bench.ab ROOT [--config configs/grpo_smollm2_cpu.yaml] [--key learner.packing] [--values false true]
                            [--steps 6] [--warmup 1] [--pairs 1] [--seeds S ...] [--set KEY=VALUE ...]

Per run: the medians over the steps after the warm-up of the learner's and the reference's phases
(timing/advantages: the old logprobs; timing/update; timing/reference; timing/total) and of
learner/packing_efficiency (real tokens / computed tokens of the update's forwards), and the held-out figures
after the run. Both runs of a pair draw the same samples from the same seed; --seeds gives each pair its own
(`seed`: prompts, sampling and init all follow it), and the table then adds each held-out figure's mean and
standard error over the pairs. Packing: the packed forward equals the padded
one to float32 rounding (tests/unit/learner/test_packing.py), so the runs may part after the first update by as
much as rounding moves a sampled token; precision: bf16 weights round where autocast's float32 weights do not.
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from bench.learner import matmul_peak_flops

PHASES = ("timing/advantages", "timing/update", "timing/reference", "timing/total", "learner/packing_efficiency")
HELD_OUT = ("eval/greedy/reward/accuracy", "eval/sampled/reward/accuracy", "eval/sampled/kl_ref")


def train(root: Path, config: str, name: str, overrides: list[str], steps: int) -> None:
    args = [config, f"run_root={root}", f"name={name}", f"total_steps={steps}", *overrides]
    args += ["logging.progress_bar=false", "logging.wandb.mode=disabled", "checkpoint.every_n_steps=0"]
    subprocess.run([sys.executable, "-m", "orchestrator.cli", "train", *args], check=True)


def figures(run_dir: Path, warmup: int) -> dict[str, float]:
    rows = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "timing/total" in r]
    out = {k: statistics.median(r[k] for r in rows[warmup:] if k in r) for k in PHASES}  # a step may train nothing
    after = json.loads((run_dir / "eval_after.json").read_text())
    return out | {k: after[k] for k in HELD_OUT}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("root", type=Path)
    p.add_argument("--config", default="configs/grpo_smollm2_cpu.yaml")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=1, help="first steps left out of the medians")
    p.add_argument("--key", default="learner.packing", help="the config key compared")
    p.add_argument("--values", nargs=2, default=["false", "true"], metavar=("A", "B"), help="its two values")
    p.add_argument("--pairs", type=int, default=1, help="A/B pairs, alternating which runs first")
    p.add_argument("--seeds", nargs="*", type=int, default=[], help="one seed per pair (sets --pairs)")
    p.add_argument("--set", nargs="*", default=[], help="overrides both runs take (KEY=VALUE)")
    a = p.parse_args()
    print(f"float32 matmul: {matmul_peak_flops() / 1e9:.0f} GFLOP/s")
    runs: dict[str, list[dict]] = {v: [] for v in a.values}
    seeds = a.seeds or [None] * a.pairs
    for pair, seed in enumerate(seeds):
        for value in a.values if pair % 2 == 0 else a.values[::-1]:
            name = f"{a.key.rpartition('.')[2]}_{value}_{pair}"
            train(
                a.root,
                a.config,
                name,
                [*a.set, f"{a.key}={value}", *([f"seed={seed}"] if seed is not None else [])],
                a.steps,
            )
            runs[value].append(figures(a.root / name, a.warmup))
    first, second = a.values
    print(f"| figure | {first} | {second} | {second} / {first} |\n|---|---|---|---|")
    for key in (*PHASES, *HELD_OUT):
        x, y = (statistics.median(r[key] for r in runs[v]) for v in a.values)
        print(f"| {key} | {x:.4f} | {y:.4f} | {f'{y / x:.3f}' if x else ''} |")
    if len(seeds) > 1:
        print(f"\n| held out, mean ± s.e. over seeds {seeds} | {first} | {second} |\n|---|---|---|")
        for key in HELD_OUT:
            print(f"| {key} | {' | '.join(mean_se([r[key] for r in runs[v]]) for v in a.values)} |")
    print(json.dumps(runs))


def mean_se(xs: list[float]) -> str:
    return f"{statistics.fmean(xs):.4f} ± {statistics.stdev(xs) / len(xs) ** 0.5:.4f}"


if __name__ == "__main__":
    main()

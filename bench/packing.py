"""Padding-free packing against padded rows on a real preset: the same `relay train` with learner.packing false and
true (the reference and reward models follow it), alternating, then one table (docs/benchmarks.md, "Packing").

    python -m bench.packing ROOT [--config configs/grpo_smollm2_cpu.yaml] [--steps 6] [--warmup 1] [--pairs 1]

Per run: the medians over the steps after the warm-up of the phases packing changes (timing/advantages: the old
logprobs; timing/update; timing/reference) and of learner/packing_efficiency (real tokens / computed tokens of the
update's forwards), and the held-out figures after the run. Both runs draw the same samples from the same seed;
the packed forward equals the padded one to float32 rounding (tests/unit/learner/test_packing.py), so the runs
may part after the first update by as much as rounding moves a sampled token.
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


def train(root: Path, config: str, name: str, packing: bool, steps: int) -> None:
    args = [config, f"run_root={root}", f"name={name}", f"total_steps={steps}", f"learner.packing={packing}"]
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
    p.add_argument("--pairs", type=int, default=1, help="padded/packed pairs, alternating which runs first")
    a = p.parse_args()
    print(f"float32 matmul: {matmul_peak_flops() / 1e9:.0f} GFLOP/s")
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for pair in range(a.pairs):
        for packing in (False, True) if pair % 2 == 0 else (True, False):
            name = f"{'packed' if packing else 'padded'}_{pair}"
            train(a.root, a.config, name, packing, a.steps)
            runs[packing].append(figures(a.root / name, a.warmup))
    print("| figure | padded | packed | packed / padded |\n|---|---|---|---|")
    for key in (*PHASES, *HELD_OUT):
        padded, packed = (statistics.median(r[key] for r in runs[k]) for k in (False, True))
        ratio = f"{packed / padded:.3f}" if padded else ""
        print(f"| {key} | {padded:.4f} | {packed:.4f} | {ratio} |")
    print(json.dumps({str(k): v for k, v in runs.items()}))


if __name__ == "__main__":
    main()

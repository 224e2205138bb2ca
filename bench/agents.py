"""The multi-turn presets learn: success rate on held-out episodes before and after training, per seed
(issue 18). Each run is `relay train` on the preset through the real stack, in its own process.

    .venv/bin/python -m bench.agents [--presets calculator_tiny_cpu,guess_number_tiny_cpu] [--seeds 0,1,2] \
        [key=value ...]

Success is the environment's reward (1 for a solved episode) of the held-out episodes: greedy
(eval/greedy/reward/accuracy) and sampled at the training temperature (eval/sampled/...). Also
prints the mean turns per episode at the first and last step (calculator: 1 = answered alone, 2-3 =
called the tool), the median seconds per step and each run's wall time. Prints a table and a final
JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KEYS = {"greedy": "eval/greedy/reward/accuracy", "sampled": "eval/sampled/reward/accuracy"}


def run(preset: str, seed: int, root: Path, overrides: list[str]) -> dict:
    name = f"{preset}_s{seed}"
    start = time.time()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "orchestrator.cli",
            "train",
            str(REPO / "configs" / f"{preset}.yaml"),
            f"seed={seed}",
            f"name={name}",
            f"run_root={root}",
            "logging.wandb.mode=disabled",
            "logging.progress_bar=false",
            *overrides,
        ],
        check=True,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
    )
    run_dir = root / name
    before, after = (json.loads((run_dir / f).read_text()) for f in ("eval_before.json", "eval_after.json"))
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_s = statistics.median(m["timing/total"] for m in steps if "timing/total" in m)
    turns = [m["env/turns_mean"] for m in steps if "env/turns_mean" in m]
    return {
        "preset": preset,
        "seed": seed,
        **{f"{k}_before": before[v] for k, v in KEYS.items()},
        **{f"{k}_after": after[v] for k, v in KEYS.items()},
        "turns_first": turns[0],
        "turns_last": turns[-1],
        "step_s": step_s,
        "wall_s": time.time() - start,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--presets", default="calculator_tiny_cpu,guess_number_tiny_cpu")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument(
        "--run-root", default="", help="default: a temporary folder (built policies are cached in runs/models)"
    )
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    root = Path(args.run_root or tempfile.mkdtemp(prefix="relay-agents-"))
    models = REPO / "runs" / "models"  # the built starting policies, shared with `relay train`'s default run_root
    (root / "models").parent.mkdir(parents=True, exist_ok=True)
    if not (root / "models").exists() and models.exists():
        (root / "models").symlink_to(models)
    rows = [
        run(preset, int(s), root, args.overrides) for preset in args.presets.split(",") for s in args.seeds.split(",")
    ]
    print(
        f"{'preset':24} {'seed':>4} {'greedy before':>14} {'after':>6} {'sampled before':>15} {'after':>6} "
        f"{'turns':>11} {'s/step':>7} {'wall s':>7}"
    )
    for r in rows:
        print(
            f"{r['preset']:24} {r['seed']:>4} {r['greedy_before']:>14.3f} {r['greedy_after']:>6.3f} "
            f"{r['sampled_before']:>15.3f} {r['sampled_after']:>6.3f} "
            f"{r['turns_first']:>5.2f}->{r['turns_last']:<4.2f} "
            f"{r['step_s']:>7.2f} {r['wall_s']:>7.0f}"
        )
    print(json.dumps({"runs": rows}))


if __name__ == "__main__":
    main()

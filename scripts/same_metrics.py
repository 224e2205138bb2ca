"""Behaviour check for refactors: run the default preset, the PPO preset and one async run, seeded, and
write every metric that is not a wall-clock figure to one JSON file; compare two such files.

    python scripts/same_metrics.py run OUT.json [--steps N]
    python scripts/same_metrics.py compare BEFORE.json AFTER.json
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

RUNS = {  # name -> relay train arguments
    "default": ["configs/grpo_tiny_cpu.yaml"],
    "ppo": ["configs/ppo_tiny_cpu.yaml"],
    "one_step": ["configs/grpo_tiny_cpu.yaml", "async_training.mode=one_step"],
}
CLOCK = ("timing/", "perf/", "throughput/", "time/", "pipeline/", "memory/")  # vary run to run by design


def deterministic(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith(CLOCK) and not k.endswith("_per_s")}


def run(out: Path, steps: int | None, root: Path) -> None:
    result = {}
    for name, args in RUNS.items():
        extra = [f"run_root={root}", f"name=same_{name}", "logging.wandb.mode=disabled"]
        extra += [f"total_steps={steps}"] if steps else []
        subprocess.run([sys.executable, "-m", "orchestrator.cli", "train", *args, *extra], check=True)
        lines = (root / f"same_{name}" / "metrics.jsonl").read_text().splitlines()
        result[name] = [deterministic(json.loads(line)) for line in lines]
    out.write_text(json.dumps(result, indent=1, sort_keys=True))


def compare(before: Path, after: Path) -> int:
    # filtered again here, so files written by an older version of this script compare alike
    a, b = ({n: [deterministic(m) for m in ms] for n, ms in json.loads(f.read_text()).items()} for f in (before, after))
    bad = 0
    for name in a:
        for step, (x, y) in enumerate(zip(a[name], b[name], strict=True)):
            diff = {k: (x.get(k), y.get(k)) for k in x.keys() | y.keys() if x.get(k) != y.get(k)}
            if diff:
                bad += 1
                print(f"{name} line {step}: {diff}")
        print(f"{name}: {len(a[name])} lines, {len(a[name][0])} metrics per line compared")
    print("same to the last digit" if not bad else f"{bad} lines differ")
    return 1 if bad else 0


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("out", type=Path)
    r.add_argument("--steps", type=int)
    r.add_argument("--run-root", type=Path, default=Path(tempfile.mkdtemp(prefix="same_metrics_")))
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    a = p.parse_args()
    sys.exit(run(a.out, a.steps, a.run_root) if a.cmd == "run" else compare(a.before, a.after))

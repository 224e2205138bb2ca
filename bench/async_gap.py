"""Does an asynchronous mode learn as much as sync? Each mode x correction x seed as a real `relay train`, then
one table of mean +- standard error over the seeds (docs/benchmarks.md, "Sync against async").

    python -m bench.async_gap run ROOT [--seeds 1,2,3] [--workload default|small]
    python -m bench.async_gap table ROOT

Figures per run: held-out greedy and sampled accuracy after the run (eval_after.json), the raw training reward and
the KL to the reference over the last 5 steps, the sampler-learner logprob gap over all steps. A seed changes the
data order and every sample's seed; the starting policy is the built-in one, the same for all.
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

RUNS = ["sync:none", "one_step:none", "one_step:tis", "in_flight:none", "in_flight:tis"]
WORKLOADS = {  # the default preset, and the small one: 16 prompts x 8 samples, 6 new tokens, 60 steps
    "default": [],
    "small": [
        "data.rollout_batch_size=16",
        "rollout.sampling.max_new_tokens=6",
        "total_steps=60",
        "data.eval_size=500",
    ],
}
FIGURES = {
    "greedy": lambda rows, after: after["eval/greedy/reward/accuracy"],
    "sampled": lambda rows, after: after["eval/sampled/reward/accuracy"],
    "reward (last 5)": lambda rows, after: statistics.fmean(r["reward/mean"] for r in rows[-5:]),
    "kl/ref (last 5)": lambda rows, after: statistics.fmean(r["kl/ref"] for r in rows[-5:]),
    "logprob gap": lambda rows, after: statistics.fmean(r["rollout/logprob_gap"] for r in rows),
}


def run(root: Path, seeds: list[int], workload: str) -> None:
    for seed in seeds:
        for spec in RUNS:
            mode, correction = spec.split(":")
            name = f"{mode}_{correction}_s{seed}"
            args = [f"run_root={root}", f"name={name}", f"seed={seed}", "logging.progress_bar=false"]
            args += ["logging.wandb.mode=disabled", f"async_training.mode={mode}"]
            args += [f"algorithm.off_policy.correction={correction}", *WORKLOADS[workload]]
            subprocess.run([sys.executable, "-m", "orchestrator.cli", "train", *args], check=True)


def figures(run_dir: Path) -> dict[str, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    rows = [r for r in map(json.loads, lines) if "timing/total" in r]
    after = json.loads((run_dir / "eval_after.json").read_text())
    return {name: f(rows, after) for name, f in FIGURES.items()}


def table(root: Path) -> str:
    found: dict[str, list[dict]] = {}
    for run_dir in sorted(root.glob("*_s*")):
        if (run_dir / "eval_after.json").exists():
            found.setdefault(run_dir.name.rsplit("_s", 1)[0], []).append(figures(run_dir))
    out = ["| mode, correction | seeds | " + " | ".join(FIGURES) + " |", "|---" * (len(FIGURES) + 2) + "|"]
    for spec in RUNS:
        runs = found.get(spec.replace(":", "_"), [])
        if runs:
            cells = [_mean_se([r[name] for r in runs]) for name in FIGURES]
            out.append(f"| {spec.replace(':', ', ')} | {len(runs)} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def _mean_se(values: list[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.3f}"
    return f"{statistics.fmean(values):.3f} ± {statistics.stdev(values) / len(values) ** 0.5:.3f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cmd", choices=["run", "table"])
    p.add_argument("root", type=Path)
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--workload", choices=list(WORKLOADS), default="default")
    args = p.parse_args()
    if args.cmd == "run":
        run(args.root, [int(s) for s in args.seeds.split(",")], args.workload)
    print(table(args.root))


if __name__ == "__main__":
    main()

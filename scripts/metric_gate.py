"""The metric-history gate: a short default run's figures against the bands several seeds drew.

    python scripts/metric_gate.py record BANDS.json RUN_DIR [RUN_DIR ...] --why "..."
    python scripts/metric_gate.py check BANDS.json RUN_DIR

`record` reads the runs of one config under different seeds and writes, per figure and per window of steps, the
seeds' window means and the band they allow; refreshing the bands is a deliberate commit that says why. `check`
fails (exit 1) on every figure that left its band, naming the figure, the steps, the band and the value.

Windows of steps, not single steps: one step's mean over 512 samples moves by a few hundredths seed to seed, and
125 single-step checks would fail somewhere on noise alone. A band is the seeds' mean +- K seed standard deviations,
and never narrower than the figure's floor. K is wide because the bands' ~26 checks must all pass on a healthy run,
a handful of seeds estimates the spread roughly (with 10 seeds a value beyond 6 estimated deviations has odds
~3e-4 per check), and another CPU's kernels round differently, which moves a run as a new seed does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

FIGURES = {  # metrics.jsonl key -> the band's half-width floor, in the figure's own unit
    # raw reward (the default run's: 1 per correct sum), per sample. 0.05: ten seeds drew steps 1-5 within 0.0054
    # of each other (the same start), and seed 0 sat 5 of those deviations off (2026-12-06): too narrow for a CPU
    "reward/mean": 0.05,
    "kl/ref": 0.01,  # KL to the reference, per token
    "learner/entropy": 0.02,  # nats per token
    "response/length_mean": 0.2,  # tokens per response
    "rollout/logprob_gap": 0.002,  # mean |sampler - learner logprob| per token: the sync's own exactness
}
HELD_OUT = {"eval/greedy/reward/accuracy": 0.03}  # eval_after.json: held-out greedy accuracy after the run
WINDOW = 5  # steps per window
K = 6.0  # seed standard deviations either side of the seeds' mean


def rows(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "timing/total" in r]  # the training rows, not the eval ones


def figures(run_dir: Path) -> dict[str, float]:
    """The run's gated figures: '<key> steps a-b' window means, and the held-out ones after the run."""
    out = {}
    train = rows(run_dir)
    for key in FIGURES:
        for start in range(0, len(train), WINDOW):
            window = train[start : start + WINDOW]
            name = f"{key} steps {window[0]['step']}-{window[-1]['step']}"
            out[name] = statistics.fmean(r[key] for r in window)
    after = json.loads((run_dir / "eval_after.json").read_text())
    out.update({key: after[key] for key in HELD_OUT})
    return out


def floor(name: str) -> float:
    key = name.split(" steps ")[0]
    return {**FIGURES, **HELD_OUT}[key]


def bands(per_seed: list[dict[str, float]]) -> dict[str, dict]:
    """Per figure: the seeds' values and the band [mean - w, mean + w], w = max(K sd, the figure's floor)."""
    out = {}
    for name in per_seed[0]:
        values = [seed[name] for seed in per_seed]
        mean, sd = statistics.fmean(values), statistics.stdev(values)
        w = max(K * sd, floor(name))
        out[name] = {"low": mean - w, "high": mean + w, "seeds": values}
    return out


def check(recorded: dict, run: dict[str, float]) -> list[str]:
    """One line per figure outside its band (or missing from either side); empty when the run is in every band."""
    failures = []
    for name, band in recorded["bands"].items():
        value = run.get(name)
        if value is None:
            failures.append(f"{name}: missing from the run (the bands have it)")
        elif not band["low"] <= value <= band["high"]:
            failures.append(f"{name} = {value:.4f}, outside its band [{band['low']:.4f}, {band['high']:.4f}]")
    failures += [f"{name}: not in the bands (record them again)" for name in run.keys() - recorded["bands"].keys()]
    return failures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("bands", type=Path)
    rec.add_argument("runs", type=Path, nargs="+")
    rec.add_argument("--why", required=True, help="why the bands are recorded anew (kept in the file)")
    chk = sub.add_parser("check")
    chk.add_argument("bands", type=Path)
    chk.add_argument("run", type=Path)
    args = p.parse_args(argv)
    if args.cmd == "record":
        if len(args.runs) < 3:
            p.error("record needs at least 3 seeds' runs: fewer cannot estimate a spread")
        recorded = {"why": args.why, "window": WINDOW, "k": K, "runs": [r.name for r in args.runs]}
        recorded["bands"] = bands([figures(r) for r in args.runs])
        args.bands.write_text(json.dumps(recorded, indent=1) + "\n")
        print(f"metric gate: {len(recorded['bands'])} bands from {len(args.runs)} runs -> {args.bands}")
        return 0
    failures = check(json.loads(args.bands.read_text()), figures(args.run))
    for line in failures:
        print(f"metric gate: {line} ({args.bands})", file=sys.stderr)
    print(f"metric gate: {'FAILED' if failures else 'passed'}, {args.run}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

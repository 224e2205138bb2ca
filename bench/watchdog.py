"""What the watchdog costs when nothing fails, and how long detection and recovery take when a process
stops or dies (issue 27). Real processes, real signals, the real loop (Trainer.run):

    .venv/bin/python -m bench.watchdog overhead [--config configs/grpo_tiny_cpu.yaml] [--steps 12] [--pairs 3]
        [--against /path/to/a/checkout/of/the/commit/before]
    .venv/bin/python -m bench.watchdog recovery [--config ...] [--steps 6] [--at 3] [key=value ...]

overhead: `relay train` runs (each its own process and Ray) with watchdog.enabled true and false, or
with --against this tree's default against another checkout's, back to back in alternating order, same
seed; the median seconds per step after 2 warm-up steps, and the ratio of each pair.
recovery: one run per failure (rollout_0 SIGSTOP, learner_0 SIGSTOP, learner_0 SIGKILL) once step --at
is done: the seconds from the signal to the watchdog's line (detection: the phase's deadline, or
Ray's own notice of a dead process) and until step --at + 1 is done (with a learner rebuilt, after the
replay of the steps since the last checkpoint), beside an undisturbed step's median. Prints a table
and a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ray

from orchestrator.config.load import load_config
from orchestrator.data.builtin_models import resolve_model_path
from orchestrator.loop.trainer import Trainer
from runtime.incidents import actor_process

REPO = Path(__file__).resolve().parents[1]
FAILURES = {"rollout_0 SIGSTOP": ("rollout_0", signal.SIGSTOP), "learner_0 SIGSTOP": ("learner_0", signal.SIGSTOP)}
FAILURES["learner_0 SIGKILL"] = ("learner_0", signal.SIGKILL)


def config(path: str, run_root: str, steps: int, overrides: list[str]):
    base = [f"total_steps={steps}", f"run_root={run_root}", "logging.wandb.mode=disabled", "logging.progress_bar=false"]
    cfg = load_config(path, base + overrides)
    cfg.learner.model_path = resolve_model_path(cfg.learner.model_path, str(REPO / "runs"))  # built once, cached
    return cfg


def overhead(path: str, steps: int, pairs: int, overrides: list[str], against: str = "") -> dict:
    """Median s/step of runs of `path`, in alternating order: watchdog on and off in this tree, or (against:
    another checkout, e.g. the commit before the watchdog) this tree's default against that one's."""
    if against:
        variants = {"this tree": (REPO, []), f"{against}": (Path(against), [])}
    else:
        variants = {
            "watchdog on": (REPO, ["watchdog.enabled=true"]),
            "watchdog off": (REPO, ["watchdog.enabled=false"]),
        }
    out: dict[str, list[float]] = {name: [] for name in variants}
    for pair in range(pairs):
        for name in list(variants) if pair % 2 == 0 else list(variants)[::-1]:
            tree, extra = variants[name]
            out[name].append(train_subprocess(tree, path, steps, [*extra, *overrides]))
            print(name, out[name][-1], flush=True)
    first, second = list(variants)
    ratios = [a / b for a, b in zip(out[first], out[second])]
    print(f"\n{Path(path).stem}: median s/step over steps 3..{steps}, {pairs} pairs, alternating order")
    print(f"| {first} | {second} | ratio |\n|---|---|---|")
    for a, b, r in zip(out[first], out[second], ratios):
        print(f"| {a:.3f} | {b:.3f} | {r:.3f} |")
    return {"s_per_step": out, "ratio_median": statistics.median(ratios)}


def train_subprocess(tree: Path, path: str, steps: int, overrides: list[str]) -> float:
    """`relay train` of `tree`'s code (its own Ray, the model cached here); the median s/step after 2 warm-up."""
    model = resolve_model_path(load_config(path, overrides).learner.model_path, str(REPO / "runs"))
    with tempfile.TemporaryDirectory() as tmp:
        base = [f"total_steps={steps}", f"run_root={tmp}", "logging.wandb.mode=disabled", "logging.progress_bar=false"]
        command = [sys.executable, "-m", "orchestrator.cli", "train", path, *base, f"learner.model_path={model}"]
        env = os.environ | {"PYTHONPATH": str(tree)}
        subprocess.run(command + overrides, cwd=tree, env=env, check=True, capture_output=True)
        rows = [json.loads(line) for line in next(Path(tmp).glob("*/metrics.jsonl")).read_text().splitlines()]
    return statistics.median(r["timing/total"] for r in rows if "timing/total" in r and r["step"] > 2)


def recovery(path: str, steps: int, at: int, overrides: list[str]) -> dict:
    out = {}
    for name, (role, sig) in FAILURES.items():
        marks: dict[str, float] = {}

        def hit(step, _metrics, role=role, sig=sig, marks=marks):
            if step == at and "signal" not in marks:  # once: a learner recovery replays the step
                os.kill(actor_process(role, trainer_of[0].roles.actors()[role]).pid, sig)
                marks["signal"] = time.perf_counter()
            elif step == at + 1 and "signal" in marks and "next" not in marks:  # after any replay
                marks["next"] = time.perf_counter()

        with tempfile.TemporaryDirectory() as tmp:
            cfg = config(path, tmp, steps, overrides)
            trainer_of = [Trainer(cfg)]
            try:
                trainer_of[0].run(on_step=hit)
            finally:
                trainer_of[0].shutdown()
                ray.shutdown()
            rows = [json.loads(line) for line in (trainer_of[0].run_dir / "metrics.jsonl").read_text().splitlines()]
            incidents = trainer_of[0].watchdog.incidents
        undisturbed = statistics.median(r["timing/total"] for r in rows if "timing/total" in r and r["step"] != at + 1)
        out[name] = {
            "detected_after_s": incidents[0].waited_s if incidents else None,  # None: Ray saw the death itself
            "step_done_after_s": marks["next"] - marks["signal"],
            "undisturbed_step_s": undisturbed,
            "restarts": {
                k: v for k, v in [r for r in rows if "timing/total" in r][-1].items() if k.startswith("restarts/")
            },
        }
        print(name, json.dumps(out[name]), flush=True)
    print(f"\n{Path(path).stem}: failure once step {at} is done")
    print("| failure | detected after (s) | disturbed step done after (s) | undisturbed step (s) |\n|---|---|---|---|")
    for name, r in out.items():
        detected = "Ray (process gone)" if r["detected_after_s"] is None else f"{r['detected_after_s']:.0f}"
        print(f"| {name} | {detected} | {r['step_done_after_s']:.1f} | {r['undisturbed_step_s']:.2f} |")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["overhead", "recovery"])
    p.add_argument("--config", default=str(REPO / "configs" / "grpo_tiny_cpu.yaml"))
    p.add_argument("--steps", type=int, default=0, help="default: 12 (overhead), 6 (recovery)")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--at", type=int, default=3, help="recovery: the step after which the signal is sent")
    p.add_argument("--against", default="", help="overhead: another checkout to compare this tree's default with")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    if a.what == "overhead":
        result = overhead(a.config, a.steps or 12, a.pairs, a.overrides, a.against)
    else:
        result = recovery(a.config, a.steps or 6, a.at, a.overrides)
    print(json.dumps(result))


if __name__ == "__main__":
    main()

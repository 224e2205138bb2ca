"""A learner rank SIGKILLed mid-run on the real stack: the group is rebuilt, the last checkpoint (or the
start) restored in process, the lost steps replayed, and the run ends exactly as one nobody disturbed, each step
recorded once: 2 ranks under ZeRO-2 here, 1 rank in test_train_e2e.py (recovered_run, against its `whole`)."""

import json
import os
import signal
import time
from pathlib import Path

import pytest

from orchestrator.config.load import load_config
from orchestrator.loop.trainer import Trainer
from scripts.same_metrics import deterministic
from tests.helpers import REPO, actor_pid, jsonl_rows

pytestmark = pytest.mark.e2e


def config(policy, root, name, ranks):
    over = {
        "learner.model_path": policy,
        "run_root": str(root),
        "name": name,
        "logging.wandb.mode": "disabled",
        "logging.progress_bar": "false",
        "data.rollout_batch_size": 16,
        "data.eval_size": 16,
        "algorithm.mini_batch_size": 64,
        "algorithm.micro_batch_size": 64 // ranks,
        "learner.lr": 2e-4,
        "total_steps": 4,
        "checkpoint.every_n_steps": 2,
        "cluster.learner_ranks": ranks,
        "learner.zero_stage": 2 if ranks > 1 else 0,
    }
    return load_config(REPO / "configs" / "grpo_tiny_cpu.yaml", [f"{k}={v}" for k, v in over.items()])


def train(cfg, kills=(), also=None):
    """Run to the end; `kills`: the steps after which the last learner rank's process is SIGKILLed (each once:
    the replay passes it again); `also(trainer, step)`: what else the test does after each step done (kill another
    role). Returns the run's counts and the seconds from the last kill to the recovery's start (detected), to its
    end (restored) and to the next step done."""
    trainer, times, killed, seen = Trainer(cfg), {}, set(), {"restored_at": [], "rows_at_last_kill": []}
    recover = trainer.recover_learner

    def timed_recovery(error):
        times["detected"] = time.perf_counter() - times["kill"]
        recover(error)
        times["restored"] = time.perf_counter() - times["kill"]
        seen["restored_at"].append(trainer.step)  # the step the recovery went back to

    trainer.recover_learner = timed_recovery

    def kill_rank(step, metrics):
        if "restored" in times and "next_step" not in times:
            times["next_step"] = time.perf_counter() - times["kill"]
        if step in kills and step not in killed:
            killed.add(step)
            times.clear()
            seen["rows_at_last_kill"] = jsonl_rows(trainer.run_dir / "metrics.jsonl")  # before the rewind drops some
            times["kill"] = time.perf_counter()
            os.kill(actor_pid(trainer.roles.learner.ranks[-1]), signal.SIGKILL)  # under ZeRO, not the sender
        if also is not None:
            also(trainer, step)

    try:
        trainer.run(on_step=kill_rank)
        return trainer.state.counts(), {k: round(v, 1) for k, v in times.items() if k != "kill"}, seen
    finally:
        trainer.shutdown()


def record(run_dir):
    """The run's per-step numbers that are not clock readings (scripts/same_metrics.py), its restarts
    aside, and its final evaluation."""
    rows = [undisturbed(r) for r in jsonl_rows(run_dir / "metrics.jsonl")]
    return rows, deterministic(json.loads((run_dir / "eval_after.json").read_text()))


def undisturbed(row: dict) -> dict:
    """A metrics row's numbers that are not clock readings, its restart counts aside (recovered_run checks those)."""
    return {k: v for k, v in deterministic(row).items() if not k.startswith("restarts/")}


def test_a_killed_rank_of_two_under_zero2_is_rebuilt_and_the_run_ends_as_an_undisturbed_one(
    ray_cluster, policy, tmp_path
):
    """Killed after step 3: back to step 2's checkpoint, both ranks rebuilt. (1 rank, killed after steps 1 and 3:
    test_train_e2e.py, against that module's uninterrupted run.)"""
    train(config(policy, tmp_path, "whole", ranks=2))
    killed = recovered_run(tmp_path / "whole", config(policy, tmp_path, "killed", ranks=2), kills=(3,))
    assert ending(killed) == ending(tmp_path / "whole")  # each step once, every number and state the undisturbed run's


def recovered_run(whole: Path, cfg, kills: tuple[int, ...], also=None, others: dict | None = None) -> Path:
    """Run `cfg` to the end, its last learner rank killed after each step of `kills` (and `also` done after each
    step: train), and check that each kill is recovered from where it must be (after step 1: no checkpoint yet,
    back to the start; after step 3: back to step 2's), each step recorded once, the steps before the last kill
    `whole`'s (an undisturbed run of the same config), and the other roles' restarts `others` (default: none).
    Returns the run folder, for ending(): what it ended with."""
    want = record(whole)
    assert [r["step"] for r in want[0]] == [1, 2, 3, 4, 4]  # the last step, then its evaluation
    counts, seconds, seen = train(cfg, kills=kills, also=also)
    ranks, killed = cfg.cluster.learner_ranks, Path(cfg.run_root) / cfg.name
    print(f"learner recovery, {ranks} rank(s), killed after steps {kills}: {seconds} s after the last kill")
    restarts = {
        "restarts/learner": len(kills),
        "restarts/rollout": 0,
        "restarts/scoring": 0,
        "restarts/relaunched_batches": 0,
    }
    restarts |= others or {}
    assert {k: counts[k] for k in restarts} == restarts
    assert seen["restored_at"] == [0 if kill < 2 else 2 for kill in kills]  # the start, or step 2's checkpoint
    # the steps a run made after every earlier recovery, up to the last kill, were the undisturbed run's too
    assert [undisturbed(r) for r in seen["rows_at_last_kill"]] == want[0][: kills[-1]]
    steps = [r for r in jsonl_rows(killed / "metrics.jsonl") if "timing/total" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]  # each step once
    assert {k: steps[-1][k] for k in restarts} == restarts  # and step 4's row
    return killed


def ending(run_dir: Path) -> tuple:
    """What a 4-step run ended with: its record(), and the scoring service's state (a reward normaliser's) at its
    last checkpoint, which a replay rewinds with the learner."""
    return record(run_dir), scoring_state(run_dir)


def scoring_state(run_dir: Path) -> dict:
    """The scoring service's state in step 4's checkpoint."""
    return json.loads((run_dir / "checkpoints" / "step_4" / "orchestrator.json").read_text())["scoring"]

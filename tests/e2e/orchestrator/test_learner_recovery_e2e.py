"""A learner rank SIGKILLed mid-run on the real stack: the group is rebuilt, the last checkpoint (or the
start) restored in process, the lost steps replayed, and the run ends exactly as one nobody disturbed
(1 rank, and 2 ranks under ZeRO-2), each step recorded once."""

import json
import os
import signal
import time

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


def train(cfg, kills=()):
    """Run to the end; `kills`: the steps after which the last learner rank's process is SIGKILLed (each once:
    the replay passes it again). Returns the run's counts and the seconds from the last kill to the recovery's
    start (detected), to its end (restored) and to the next step done."""
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
    """A metrics row's numbers that are not clock readings, its learner restarts aside."""
    return {k: v for k, v in deterministic(row).items() if k != "restarts/learner"}


@pytest.mark.parametrize("ranks, kills", [(1, (1, 3)), (2, (3,))], ids=["1_rank", "2_ranks_zero2"])
def test_a_killed_learner_rank_is_rebuilt_and_the_run_ends_as_an_undisturbed_one(
    ray_cluster, policy, tmp_path, ranks, kills
):
    """Killed after step 1: no checkpoint yet, back to the start (step 0); after step 3: back to step 2's
    (with 1 rank both in one run, which replays steps 1-3 after the first kill: one run's start, CI time)."""
    train(config(policy, tmp_path, "whole", ranks))
    want = record(tmp_path / "whole")
    assert [r["step"] for r in want[0]] == [1, 2, 3, 4, 4]  # the last step, then its evaluation
    counts, seconds, seen = train(config(policy, tmp_path, "killed", ranks), kills=kills)
    print(f"learner recovery, {ranks} rank(s), killed after steps {kills}: {seconds} s after the last kill")
    assert counts["restarts/learner"] == len(kills) and counts["restarts/rollout"] == 0
    assert seen["restored_at"] == [0 if kill < 2 else 2 for kill in kills]  # the start, or step 2's checkpoint
    # the steps a run made after every earlier recovery, up to the last kill, were the undisturbed run's too
    assert [undisturbed(r) for r in seen["rows_at_last_kill"]] == want[0][: kills[-1]]
    rows = jsonl_rows(tmp_path / "killed" / "metrics.jsonl")
    assert [r["step"] for r in rows if "timing/total" in r] == [1, 2, 3, 4]  # each step once
    assert [r["restarts/learner"] for r in rows if "timing/total" in r][-1] == len(kills)
    assert record(tmp_path / "killed") == want  # each step once, every number the undisturbed run's

"""The watchdog on the real stack: a stopped process (SIGSTOP, as a wedged GPU or a stuck kernel leaves
it) is named within its phase's deadline, killed and restarted, and the run finishes, each step logged
once. Deadlines here are phase multiples (watchdog.factor) over a small floor, never wall-clock asserts."""

import json
import os
import signal

import pytest

from orchestrator.loop.trainer import Trainer
from runtime.incidents import actor_process
from tests.e2e.orchestrator.test_train_e2e import config, metrics

pytestmark = pytest.mark.e2e

WATCHDOG = {"watchdog.factor": 4, "watchdog.floor_s": 15}  # the floor: a restarting engine takes both cores


def run_stopping(cfg, role: str, at_step: int):
    """Run to the end, SIGSTOP-ing `role`'s process (e.g. rollout_0) once step `at_step` is done.
    Returns the trainer's counters and the stopped pid."""
    trainer = Trainer(cfg)
    stopped = {}

    def stop_role(step, _metrics):
        if step == at_step and not stopped:  # once: a learner recovery replays the step
            stopped["pid"] = actor_process(role, trainer.roles.actors()[role]).pid
            os.kill(stopped["pid"], signal.SIGSTOP)

    try:
        trainer.run(on_step=stop_role)
        return trainer.state.counts(), stopped["pid"], trainer.watchdog.incidents
    finally:
        trainer.shutdown()


def incident_folders(run_dir):
    return sorted((run_dir / "incidents").iterdir())


@pytest.mark.parametrize("mode", ["one_step"])  # sync: test_an_engine_stopped_in_the_sync_and...
def test_a_stopped_rollout_engine_is_named_restarted_and_the_run_finishes(ray_cluster, policy, tmp_path, mode):
    name = f"stopped_engine_{mode}"
    cfg = config(policy, tmp_path, name=name, total_steps=4, **{"async_training.mode": mode}, **WATCHDOG)
    counts, pid, incidents = run_stopping(cfg, "rollout_0", at_step=2)
    assert counts["restarts/rollout"] == 1
    assert len(incidents) == 1 and [p.role for p in incidents[0].culprits] == ["rollout_0"]
    assert incidents[0].culprits[0].pid == pid and incidents[0].culprits[0].stopped
    (folder,) = incident_folders(tmp_path / name)
    summary = json.loads((folder / "incident.json").read_text())
    assert summary["step"] == 2 and summary["stuck"][0]["pid"] == pid and summary["stuck"][0]["stopped"]
    assert f"pid {pid}" in summary["line"] and "rollout_0 (RolloutWorker" in summary["line"]
    stacks = {p.stem: p.read_text() for p in (folder / "stacks").iterdir()}
    assert set(stacks) == {"rollout_0", "scoring", "learner_0"}
    assert "Thread" in stacks["rollout_0"]  # py-spy read the stopped process
    assert json.loads((folder / "config.json").read_text())["name"] == name
    assert "reward/mean" in json.loads((folder / "last_metrics.json").read_text())
    rows = metrics(tmp_path / name)
    steps = [r["step"] for r in rows if "timing/total" in r]
    assert steps == [1, 2, 3, 4]
    assert len(json.loads((tmp_path / name / "eval_after.json").read_text())) > 0


def test_an_engine_stopped_in_the_sync_and_a_stopped_learner_rank_are_each_named_and_restarted(
    ray_cluster, policy, tmp_path
):
    """Two incidents in one run (one run's start for both, CI time), with 2 ZeRO-2 learner ranks:
    - the engine stops just as step 2's sync starts: the learner's broadcast waits on it (gloo), the sync's deadline
      names the engine, which is killed; the broadcast then fails, the engine is restarted, the group rebuilt and
      the weights sent again;
    - the last learner rank stops after step 2: rank 0 then waits in a collective, and both ranks are rebuilt
      (one rank's rebuild: test_train_e2e.py, SIGKILL)."""
    name = "stopped_twice"
    zero = {"cluster.learner_ranks": 2, "learner.zero_stage": 2, "algorithm.micro_batch_size": 32}
    cfg = config(policy, tmp_path, name=name, total_steps=3, **zero, **WATCHDOG)
    trainer = Trainer(cfg)
    send, stopped = trainer.roles.channel.send, {}

    def stop_then_send(version, wait=True):
        if version == 2 and "engine" not in stopped:  # once: the learner's rebuild sends version 2 again
            stopped["engine"] = actor_process("rollout_0", trainer.roles.rollout.workers[0]).pid
            os.kill(stopped["engine"], signal.SIGSTOP)
        return send(version, wait)

    def stop_learner(step, _metrics):
        if step == 2 and "learner" not in stopped:  # once: the recovery replays the step
            stopped["learner"] = actor_process("learner_1", trainer.roles.actors()["learner_1"]).pid
            os.kill(stopped["learner"], signal.SIGSTOP)

    trainer.roles.channel.send = stop_then_send
    try:
        trainer.run(on_step=stop_learner)
        counts, incidents = trainer.state.counts(), trainer.watchdog.incidents
    finally:
        trainer.shutdown()
    assert counts["restarts/rollout"] == 1 and counts["restarts/learner"] == 1
    in_sync, learner = incidents
    assert in_sync.phase == "sync" and [p.role for p in in_sync.culprits] == ["rollout_0"]
    assert in_sync.culprits[0].pid == stopped["engine"]
    assert learner.culprits[0].role == "learner_1" and learner.culprits[0].pid == stopped["learner"]
    assert learner.culprits[0].stopped and sorted(p.role for p in learner.culprits) == ["learner_0", "learner_1"]
    folders = incident_folders(tmp_path / name)
    assert len(folders) == 2 and "rebuilds" in json.loads((folders[1] / "incident.json").read_text())["action"]
    assert [r["step"] for r in metrics(tmp_path / name) if "timing/total" in r] == [1, 2, 3]

"""The watchdog on the real stack: a stopped process (SIGSTOP, as a wedged GPU or a stuck kernel leaves
it) is named within its phase's deadline, killed and restarted, and the run finishes, each step logged
once; the one_step run also meets an engine that died (ray.kill) mid-generation. Two incidents share a run
(CI time). Deadlines here are phase multiples (watchdog.factor) over a small floor, never wall-clock asserts."""

import json
import os
import signal

import pytest
import ray

from orchestrator.data.prompts import PromptSampler
from orchestrator.loop.trainer import Trainer
from tests.e2e.orchestrator.test_train_e2e import config, metrics
from tests.helpers import actor_pid

pytestmark = pytest.mark.e2e

WATCHDOG = {"watchdog.factor": 4, "watchdog.floor_s": 15}  # the floor: a restarting engine takes both cores


def incident_folders(run_dir):
    return sorted((run_dir / "incidents").iterdir())


def sigstop(actor) -> int:
    """Stop the actor's process (SIGSTOP: it stays alive, as a wedged kernel leaves it); returns its pid."""
    pid = actor_pid(actor)
    os.kill(pid, signal.SIGSTOP)
    return pid


def test_one_step_off_loses_no_prompt_when_an_engine_is_killed_mid_generation_or_stopped(ray_cluster, policy, tmp_path):
    """One one_step run, two rollout incidents (one run's start for both, CI time):
    - the engine is killed (Ray restarts it) right after step 3's batch was queued on it: the batch is regenerated;
    - the engine is stopped (SIGSTOP) after step 4: the watchdog names it within its phase's deadline, writes the
      incident folder, kills it, and it is restarted.
    Every batch the learner trains on is the sampler's next, none lost or trained twice, and the run finishes."""
    name = "one_step_engine"
    cfg = config(policy, tmp_path, name=name, total_steps=6, **{"async_training.mode": "one_step"}, **WATCHDOG)
    trainer = Trainer(cfg)
    trained, killed, stopped = [], [], {}  # trained: the prompts of every batch the learner trained on, in order
    batches, pool = trainer.batches, trainer.roles.rollout
    next_batch, submit = batches.next, pool.submit

    def recording(step):
        this = next_batch(step)
        trained.append([e["prompt"] for e in this.examples])
        return this

    def killing(prompts, step, *args, **kwargs):
        pending = submit(prompts, step, *args, **kwargs)
        if step == 2 and not killed:
            killed.append(step)
            ray.kill(pool.workers[0], no_restart=False)
        return pending

    def stop_engine(step, _metrics):
        if step == 4 and not stopped:
            stopped["pid"] = sigstop(pool.workers[0])

    batches.next, pool.submit = recording, killing
    try:
        trainer.run(on_step=stop_engine)
        counts, (incident,) = trainer.state.counts(), trainer.watchdog.incidents
    finally:
        trainer.shutdown()
    got = [r for r in metrics(tmp_path / name) if "timing/total" in r]
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6] and counts["restarts/rollout"] == 2
    assert got[3]["restarts/rollout"] == 1  # the kill's restart, counted once, before the engine was stopped
    # no prompt lost or trained twice: exactly the sampler's order, one batch per step
    sampler, train = PromptSampler(len(batches.train), cfg.seed, cfg.data.shuffle), batches.train
    assert trained == [[train[i]["prompt"] for i in sampler.next(cfg.data.rollout_batch_size)] for _ in range(6)]
    # the regenerated batch came from the current weights; the others one version behind
    assert [r["async/staleness_max"] for r in got[:4]] == [0.0, 1.0, 0.0, 1.0]

    assert [p.role for p in incident.culprits] == ["rollout_0"]
    assert incident.culprits[0].pid == stopped["pid"] and incident.culprits[0].stopped
    (folder,) = incident_folders(tmp_path / name)
    summary = json.loads((folder / "incident.json").read_text())
    assert summary["step"] == 4 and summary["stuck"][0]["pid"] == stopped["pid"] and summary["stuck"][0]["stopped"]
    assert f"pid {stopped['pid']}" in summary["line"] and "rollout_0 (RolloutWorker" in summary["line"]
    stacks = {p.stem: p.read_text() for p in (folder / "stacks").iterdir()}
    assert set(stacks) == {"rollout_0", "scoring", "learner_0"}
    assert "Thread" in stacks["rollout_0"]  # py-spy read the stopped process
    assert json.loads((folder / "config.json").read_text())["name"] == name
    assert "reward/mean" in json.loads((folder / "last_metrics.json").read_text())
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
        if version == 2 and "engine" not in stopped:  # once: the replayed step 2 sends version 2 again
            stopped["engine"] = sigstop(trainer.roles.rollout.workers[0])
        return send(version, wait)

    def stop_learner(step, _metrics):
        if step == 2 and "learner" not in stopped:  # once: the recovery replays the step
            stopped["learner"] = sigstop(trainer.roles.actors()["learner_1"])

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

"""A dead learner rank through Trainer.run's loop on stand-in roles (no Ray): the group is restarted, the
last checkpoint (or the start) restored, the lost steps replayed, and each step recorded once; which
counts a restore keeps; beyond cluster.max_restarts the run ends with LearnerLost, resumable."""

import pytest
import ray

from orchestrator.cli import _parser, resume_command
from orchestrator.loop.loop_state import restored_counters
from orchestrator.loop.recovery import LearnerLost
from orchestrator.loop.tracking import WandbSteps
from tests.helpers import REPO
from tests.helpers import jsonl_rows as rows
from tests.small_loop import Learner, small_trainer


def test_a_restore_in_process_keeps_the_restarts_and_takes_every_other_count():
    now = {"restarts/learner": 1, "restarts/rollout": 2, "async/dropped_stale": 8, "rollout/dropped_groups": 5}
    saved = {"restarts/learner": 0, "restarts/rollout": 1, "async/dropped_stale": 3, "rollout/dropped_groups": 0}
    assert restored_counters(now, saved, in_process=True) == {
        "restarts/learner": 1,
        "restarts/rollout": 2,
        "async/dropped_stale": 3,
        "rollout/dropped_groups": 0,
    }
    assert restored_counters(now, saved, in_process=False) == saved  # a resumed run goes on with the checkpoint's
    older = {k: v for k, v in saved.items() if k != "restarts/learner"}  # a checkpoint from before the count
    assert restored_counters(now, older, in_process=False)["restarts/learner"] == 1


def test_wandb_gets_a_replayed_step_only_beyond_the_ones_it_has():
    steps = WandbSteps()
    for s in (0, 1, 2, 3):
        assert steps.new(s)
        steps.logged(s)
    steps.replaying()  # rewound to step 1: steps 2 and 3 are replayed
    assert [s for s in (2, 3, 4) if steps.new(s, training_row=True)] == [4]
    # wandb's current step (3) still takes what comes after its training row: a final evaluation
    assert [s for s in (2, 3, 4) if steps.new(s)] == [3, 4]
    steps.logged(4)
    steps.replaying()  # a second rewind, to step 3
    assert not steps.new(4, training_row=True) and steps.new(5, training_row=True)


class DyingLearner(Learner):
    """The learner group whose rank 0 dies in the train calls numbered in `deaths` (0 = the first)."""

    def __init__(self, calls, deaths):
        super().__init__(calls)
        self.deaths, self.trains = set(deaths), 0

    def train(self, step):
        self.trains += 1
        if self.trains - 1 in self.deaths:
            raise ray.exceptions.RayActorError("rank 0", "The actor died unexpectedly before finishing this task.")
        return super().train(step)


def dying_trainer(tmp_path, deaths, *overrides):
    t, calls = small_trainer(tmp_path, "total_steps=5", "logging.wandb.mode=offline", *overrides)
    t.roles.learner = DyingLearner(calls, deaths)
    return t, calls


@pytest.mark.parametrize("checkpoint_every", [0, 2])
def test_a_dead_learner_is_restarted_restored_and_its_steps_replayed_each_recorded_once(
    tmp_path, fake_wandb, checkpoint_every
):
    # rank 0 dies in the 4th train call (step 4): back to step 2's checkpoint, or to the start without one
    t, calls = dying_trainer(tmp_path, {3}, f"checkpoint.every_n_steps={checkpoint_every}", "eval.every_n_steps=2")
    t.run()
    restored = 2 if checkpoint_every else 0
    assert calls.count("restart learner") == 1 and "connect" in calls
    assert (("load", "step_2") in calls) == bool(checkpoint_every)
    restart = calls.index("restart learner")
    assert next(c for c in calls[restart:] if c[0] == "sync") == ("sync", restored)  # the restored policy
    assert t.step == 5 and t.state.counts()["restarts/learner"] == 1
    trained = [r for r in rows(t.run_dir / "metrics.jsonl") if "timing/total" in r]
    assert [r["step"] for r in trained] == [1, 2, 3, 4, 5]
    assert [r["restarts/learner"] for r in trained] == [0] * restored + [1] * (5 - restored)  # the replay's rows
    run = fake_wandb.run
    assert not run.dropped, run.dropped
    logged = [step for data, step in run.calls if "timing/total" in data]
    assert logged == [1, 2, 3, 4, 5]  # each step once: the replayed 1..3 (or 3) not again
    assert [r["step"] for r in rows(t.run_dir / "samples.jsonl")] == [0, 2, 4, 5]  # the sample tables too
    assert [step for data, step in run.calls if "eval/samples" in data] == [0, 2, 4, 5]
    # the sampler was restored too: the replayed steps train on the prompts (and seeds) they first did
    submits = [c for c in calls if c[0] == "submit"]
    first, again = submits[:4], [c for c in calls[restart:] if c[0] == "submit"]
    assert again[: 4 - restored] == first[restored:] and len(again) == 5 - restored


def test_a_replay_under_one_step_async_launches_the_batches_the_first_pass_launched(tmp_path):
    # one_step: the batch of the step after is launched ahead; the restore replaces the queue with the
    # checkpoint's (its batches collected) and the replay launches from there as the first pass did
    t, calls = dying_trainer(tmp_path, {3}, "checkpoint.every_n_steps=2", "async_training.mode=one_step")
    t.run()
    restart = calls.index("restart learner")
    first = [c for c in calls[:restart] if c[0] == "submit"]
    again = [c for c in calls[restart:] if c[0] == "submit"]
    assert first == [("submit", s, 2 * s + 2) for s in range(5)]  # steps 0-4 launched (4 ahead of step 3)
    assert again == first[3:]  # step 3's batch came back with the checkpoint, collected: 3 and 4 again
    assert [r["step"] for r in rows(t.run_dir / "metrics.jsonl") if "timing/total" in r] == [1, 2, 3, 4, 5]


def test_a_learner_that_keeps_dying_ends_the_run_resumable_after_max_restarts(tmp_path, fake_wandb):
    t, calls = dying_trainer(tmp_path, {1, 2, 3}, "cluster.max_restarts=2", "checkpoint.every_n_steps=1")
    with pytest.raises(LearnerLost) as e:
        t.run()
    assert calls.count("restart learner") == 2 and e.value.step == 1
    assert e.value.checkpoint == t.run_dir / "checkpoints" / "step_1"
    assert "a learner rank died in step 2 (RayActorError) after 2 learner restarts" in str(e.value)
    assert [r["step"] for r in rows(t.run_dir / "metrics.jsonl")] == [1]


def test_with_a_batch_source_that_cannot_replay_a_learner_death_ends_the_run_resumable(tmp_path, fake_wandb):
    # the agent endpoint's episodes are new ones on every pass: a replay would train on samples from the future
    t, calls = dying_trainer(tmp_path, {2}, "checkpoint.every_n_steps=1")
    t.batches.replayable = False
    with pytest.raises(LearnerLost) as e:
        t.run()
    assert "restart learner" not in calls and e.value.step == 2
    assert "with the agent endpoint, whose episodes cannot be replayed in process" in str(e.value)


def test_a_learner_death_in_the_weight_sync_goes_to_the_learner_not_to_an_engine_restart(tmp_path):
    t, calls = small_trainer(tmp_path, "total_steps=3")
    sent = []

    def send(version, wait=True):
        sent.append(version)
        if len(sent) == 2:  # step 2's sync: the sender, learner rank 0, died
            raise ray.exceptions.RayActorError("rank 0")

    t.roles.channel.send = send
    t.run()
    assert t.roles.rollout_restarts == 0 and t.roles.learner_restarts == 1
    assert sent == [1, 2, 0, 1, 2, 3]  # back to the start (no checkpoint): version 0 to the engines, then replayed


def test_the_cli_names_the_command_that_resumes():
    args = _parser().parse_args(["train", "configs/x.yaml", "total_steps=3", "checkpoint.resume=never"])
    assert resume_command(args) == "relay train configs/x.yaml total_steps=3 checkpoint.resume=auto"


class DyingInSave(Learner):
    """The learner group whose rank 0 dies in its first checkpoint save."""

    def __init__(self, calls):
        super().__init__(calls)
        self.saves = 0

    def save(self, path):
        self.saves += 1
        if self.saves == 1:
            raise ray.exceptions.RayActorError("rank 0")
        return super().save(path)


def test_a_learner_death_in_a_checkpoint_save_replays_from_the_one_before(tmp_path, fake_wandb):
    t, calls = small_trainer(tmp_path, "total_steps=4", "checkpoint.every_n_steps=2", "logging.wandb.mode=offline")
    t.roles.learner = DyingInSave(calls)
    t.run()
    assert t.roles.learner_restarts == 1 and ("save", "step_2.tmp") in calls
    assert [r["step"] for r in rows(t.run_dir / "metrics.jsonl") if "timing/total" in r] == [1, 2, 3, 4]
    assert [step for data, step in fake_wandb.run.calls if "timing/total" in data] == [1, 2, 3, 4]
    assert sorted(p.name for p in (t.run_dir / "checkpoints").iterdir()) == ["step_2", "step_4"]


def test_relay_train_ends_a_lost_learner_with_the_resumable_status_and_the_command(tmp_path, monkeypatch, capsys):
    import orchestrator.loop.trainer as trainer

    class LosesItsLearner:
        def __init__(self, cfg):
            pass

        def run(self, stop):
            raise LearnerLost(2, 6, tmp_path / "checkpoints" / "step_5", ray.exceptions.ActorDiedError())

        def shutdown(self):
            pass

    monkeypatch.setattr(trainer, "Trainer", LosesItsLearner)
    from orchestrator.cli import main

    status = main(["train", f"run_root={tmp_path}", "logging.wandb.mode=disabled"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 3 and len(err) == 1, err  # one line, no traceback
    assert "a learner rank died in step 7 (ActorDiedError) after 2 learner restarts" in err[0]
    assert err[0].endswith(
        f"relay train {REPO}/configs/grpo_tiny_cpu.yaml run_root={tmp_path} "
        "logging.wandb.mode=disabled checkpoint.resume=auto"
    )


@pytest.mark.parametrize("mode", ["sync", "one_step"])
def test_every_call_the_loop_makes_on_a_role_is_made_under_a_watched_phase(tmp_path, mode):
    """So every wait it makes on a remote call has a deadline (runtime/watchdog.py): none outside a phase."""
    from runtime import watchdog

    t, _ = small_trainer(tmp_path, "total_steps=3", f"async_training.mode={mode}", "eval.every_n_steps=2")
    seen = []

    def watched(role, name, method):
        def call(*args, **kwargs):
            active = watchdog._active
            seen.append((role, name, active.watched.name if active and active.watched else None))
            return method(*args, **kwargs)

        return call

    roles = {"rollout": t.roles.rollout, "scoring": t.roles.scoring, "learner": t.roles.learner}
    roles["channel"] = t.roles.channel
    for role, obj in roles.items():
        for name in [n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n))]:
            setattr(obj, name, watched(role, name, getattr(obj, name)))
    t.run()
    assert {(role, name) for role, name, _ in seen} >= {("rollout", "busy_seconds"), ("learner", "train")}
    assert [call for call in seen if call[2] is None] == []


class DyingInLastSave(Learner):
    """The learner group whose rank 0 dies once, saving the run's last checkpoint (step_4)."""

    def __init__(self, calls):
        super().__init__(calls)
        self.died = False

    def save(self, path):
        if path.parent.name == "step_4.tmp" and not self.died:
            self.died = True
            raise ray.exceptions.RayActorError("rank 0")
        return super().save(path)


def test_after_a_death_in_the_last_save_the_final_evaluation_still_reaches_wandb_and_each_row_once(
    tmp_path, fake_wandb
):
    t, calls = small_trainer(tmp_path, "total_steps=4", "checkpoint.every_n_steps=2", "logging.wandb.mode=offline")
    t.roles.learner = DyingInLastSave(calls)
    t.run()
    logged = fake_wandb.run.calls
    assert [step for data, step in logged if "timing/total" in data] == [1, 2, 3, 4]
    final = [data for data, step in logged if step == 4 and "timing/total" not in data]
    assert any(k.startswith("eval/") for data in final for k in data)
    assert [r["step"] for r in rows(t.run_dir / "metrics.jsonl") if "timing/total" in r] == [1, 2, 3, 4]


def test_a_death_in_the_restores_weight_sync_is_reported_at_the_restored_step(tmp_path, fake_wandb):
    # step 4 dies; the recovery restores step 2's checkpoint and sends its weights, and a rank dies in that
    # send: the loop is at step 2 from the restore on, so the next try and LearnerLost name step 3
    t, calls = dying_trainer(tmp_path, {3}, "cluster.max_restarts=1", "checkpoint.every_n_steps=2")
    send, seen = t.roles.channel.send, []

    def send_dying_after_restore(version, wait=True):
        seen.append((version, t.step, t.incident()["step"]))  # what the loop and an incident folder say then
        if "restart learner" in calls and len([s for s in seen if s[0] == 2]) == 2:
            raise ray.exceptions.RayActorError("rank 0", "The actor died unexpectedly before finishing this task.")
        return send(version, wait)

    t.roles.channel.send = send_dying_after_restore
    with pytest.raises(LearnerLost) as e:
        t.run()
    assert seen[-1] == (2, 2, 2)  # the restored checkpoint's weights, sent with the loop at its step
    assert e.value.step == 2 and "a learner rank died in step 3" in str(e.value)

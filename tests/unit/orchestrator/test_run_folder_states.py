"""A run in a run folder that already holds another run, through the real Trainer on stand-in roles (no
Ray): fresh, resumed, resumed from an older checkpoint, rebuilt after a learner death. Its checkpoints,
metrics.jsonl rows, wandb rows, sample tables and end line are its own; the other run is set aside in
runs/<name>/set_aside/<its lineage>/, whole and untouched, never deleted (orchestrator/loop/run_folder.py)."""

import json
from pathlib import Path

import pytest
import ray

from orchestrator.loop.endings import ending
from orchestrator.loop.run_folder import LEGACY, checkpoints, lineage_of
from orchestrator.loop.signals import Stopped, StopRequest
from tests.helpers import jsonl_rows as rows
from tests.small_loop import STATS, small_trainer
from tests.unit.orchestrator.test_learner_recovery import DyingLearner

COMMAND = "relay train configs/grpo_tiny_cpu.yaml checkpoint.resume=auto"


def process(tmp_path, n, *over, deaths=()):
    """The n-th process to train in tmp_path/small: its rows carry run/tag n, its checkpoints hold "run n";
    its learner dies in the train calls numbered in `deaths`. Every step checkpointed, the last 2 kept."""
    over = ("logging.wandb.mode=offline", "checkpoint.every_n_steps=1", "checkpoint.keep_last=2", *over)
    t, calls = small_trainer(tmp_path, *over, stats=STATS | {"run/tag": float(n)}, tag=f"run {n}")
    if deaths:
        dying = DyingLearner(calls, deaths)
        dying.stats, dying.tag, dying.restored = t.roles.learner.stats, t.roles.learner.tag, t.roles.learner.restored
        t.roles.learner = dying
    return t, calls


def stopped_at(t, step: int) -> Stopped:
    """Run `t`, stopped (as by SIGTERM) after `step`."""
    stop = StopRequest()

    def hook(done, metrics):
        if done == step:
            stop.request("SIGTERM")

    with pytest.raises(Stopped) as e:
        t.run(stop, hook)
    return e.value


def written(root: Path) -> dict[int, str]:
    """{step: the process that wrote it} of the complete checkpoints under `root`."""
    return {s: (p / "learner" / "weights").read_text() for s, p in checkpoints(root)}


def trained(path: Path) -> list[tuple[int, float]]:
    """(step, run/tag) of each training row of a metrics.jsonl."""
    return [(r["step"], r["run/tag"]) for r in rows(path) if "timing/total" in r]


@pytest.fixture
def first(tmp_path, fake_wandb):
    """A first run (process 1) trained to step 5 in the folder: step_4 and step_5 kept, its rows, eval files
    and wandb run. Returns (its lineage, its wandb id, its metrics.jsonl as written)."""
    a, _ = process(tmp_path, 1, "total_steps=5")
    a.run()
    return (
        a.checkpointer.lineage,
        (a.run_dir / "wandb_id").read_text().strip(),
        (a.run_dir / "metrics.jsonl").read_text(),
    )


def fresh(tmp_path):
    t, _ = process(tmp_path, 2, "total_steps=3")
    t.run()
    return [t], {2: "run 2", 3: "run 2"}, [(1, 2), (2, 2), (3, 2)]


def resumed(tmp_path):
    b, _ = process(tmp_path, 2, "total_steps=4")
    assert stopped_at(b, 2).checkpoint == b.run_dir / "checkpoints" / "step_2"
    c, _ = process(tmp_path, 3, "total_steps=4", "checkpoint.resume=auto")
    assert c.step == 2 and c.roles.learner.restored == "run 2"
    c.run()
    return [b, c], {3: "run 3", 4: "run 3"}, [(1, 2), (2, 2), (3, 3), (4, 3)]


def resumed_from_an_older_checkpoint(tmp_path):
    keep = "checkpoint.keep_last=3"
    b, _ = process(tmp_path, 2, "total_steps=4", keep)
    b.run()  # steps 2-4 kept
    older = f"checkpoint.resume={b.run_dir / 'checkpoints' / 'step_2'}"
    c, _ = process(tmp_path, 3, "total_steps=4", keep, older)
    branch = b.run_dir / "set_aside" / f"{b.checkpointer.lineage}.after_step_2"
    assert written(branch / "checkpoints") == {3: "run 2", 4: "run 2"}  # the branch it leaves, set aside
    assert trained(branch / "metrics.jsonl") == [(1, 2), (2, 2), (3, 2), (4, 2)]
    assert (branch / "eval_after.json").exists() and not (b.run_dir / "eval_after.json").exists()
    stopped_at(c, 3)
    d, _ = process(tmp_path, 4, "total_steps=4", keep, "checkpoint.resume=auto")
    assert d.step == 3 and d.roles.learner.restored == "run 3"  # the new step 3, not the branch's step 4
    d.run()
    return [b, c, d], {2: "run 2", 3: "run 3", 4: "run 4"}, [(1, 2), (2, 2), (3, 3), (4, 4)]


def rebuilt_after_a_death(tmp_path):
    t, calls = process(tmp_path, 2, "total_steps=4", deaths={3})  # dies in step 4: back to its step 3
    t.run()
    assert calls.count("restart learner") == 1 and t.roles.learner.restored == "run 2"
    return [t], {3: "run 2", 4: "run 2"}, [(1, 2), (2, 2), (3, 2), (4, 2)]


@pytest.mark.parametrize("story", [fresh, resumed, resumed_from_an_older_checkpoint, rebuilt_after_a_death])
def test_a_run_in_a_folder_that_holds_another_keeps_to_its_own_and_sets_the_other_aside(
    tmp_path, fake_wandb, first, story
):
    a_lineage, a_wandb, a_metrics = first
    processes, checkpointed, rows_written = story(tmp_path)
    run_dir, lineage = processes[0].run_dir, processes[0].checkpointer.lineage
    assert lineage != a_lineage and {p.checkpointer.lineage for p in processes} == {lineage}
    # checkpoints: this run's, each from the process that wrote it
    assert written(run_dir / "checkpoints") == checkpointed
    assert {lineage_of(p) for _, p in checkpoints(run_dir / "checkpoints")} == {lineage}
    # its rows, its sample tables (before training and its final evaluation), its wandb run
    assert trained(run_dir / "metrics.jsonl") == rows_written
    last = rows_written[-1][0]
    assert [r["step"] for r in rows(run_dir / "samples.jsonl")] == [0, last]
    wandb_id = (run_dir / "wandb_id").read_text().strip()
    run = fake_wandb.runs[wandb_id]
    assert wandb_id != a_wandb and not run.dropped
    assert {s: d["run/tag"] for s, d in run.logged.items() if "timing/total" in d} == dict(rows_written)
    # the end line names this run's last checkpoint
    status, line = ending(ray.exceptions.ActorDiedError(), run_dir, COMMAND)
    assert line.endswith(f"to continue from checkpoint step {max(checkpointed)}: {COMMAND}")
    # the first run, set aside whole: its checkpoints, rows, evaluation and wandb run as it left them
    aside = run_dir / "set_aside" / a_lineage
    assert written(aside / "checkpoints") == {4: "run 1", 5: "run 1"}
    assert (aside / "metrics.jsonl").read_text() == a_metrics and (aside / "eval_after.json").exists()
    assert (aside / "wandb_id").read_text().strip() == a_wandb
    assert {s: d["run/tag"] for s, d in fake_wandb.runs[a_wandb].logged.items() if "run/tag" in d} == {
        s: 1.0 for s in range(1, 6)
    }


def test_a_fresh_run_sets_the_other_aside_and_its_stop_resume_and_recovery_stay_its_own(
    tmp_path, fake_wandb, first, capsys
):
    """Issue 40, item 1: a fresh run (B) under the name of one that went further (A, to step 5) had each
    checkpoint it wrote deleted by its own retention, its stop line named a deleted step_3, resume=auto
    continued A, and a learner recovery crashed on the deleted checkpoint."""
    a_lineage = first[0]
    capsys.readouterr()
    b, _ = process(tmp_path, 2, "total_steps=5")
    aside = b.run_dir / "set_aside" / a_lineage
    said = capsys.readouterr().out
    assert f"held another run ({a_lineage}, checkpoints up to step_5): set aside, not deleted, in {aside}" in said
    assert f"checkpoint.resume={aside / 'checkpoints' / 'step_5'} continues it here" in said
    assert "checkpoint.resume=auto continues the folder's run and name=<another> starts one beside it" in said
    stop = stopped_at(b, 3)
    assert stop.checkpoint == b.run_dir / "checkpoints" / "step_3" and str(stop.checkpoint) in str(stop)
    assert written(b.run_dir / "checkpoints") == {2: "run 2", 3: "run 2"}
    c, calls = process(tmp_path, 3, "total_steps=5", "checkpoint.resume=auto", deaths={0})  # dies at once
    assert c.step == 3 and c.roles.learner.restored == "run 2"  # B's state, not A's
    c.run()
    assert [x for x in calls if x[0] == "load"] == [("load", "step_3")] * 2  # resumed, then recovered: B's
    assert c.roles.learner.restored == "run 2"
    assert c.state.counts()["restarts/learner"] == 1 and c.checkpointer.lineage == b.checkpointer.lineage
    assert trained(c.run_dir / "metrics.jsonl") == [(1, 2), (2, 2), (3, 2), (4, 3), (5, 3)]
    assert written(b.run_dir / "checkpoints") == {4: "run 3", 5: "run 3"}


def test_a_set_aside_run_continues_from_its_checkpoint_by_path_and_sets_the_folders_run_aside(
    tmp_path, fake_wandb, first
):
    a_lineage = first[0]
    b, _ = process(tmp_path, 2, "total_steps=3")
    b.run()
    back = b.run_dir / "set_aside" / a_lineage / "checkpoints" / "step_5"
    c, _ = process(tmp_path, 3, "total_steps=6", f"checkpoint.resume={back}")
    assert c.step == 5 and c.roles.learner.restored == "run 1" and c.checkpointer.lineage == a_lineage
    c.run()
    assert written(b.run_dir / "checkpoints") == {6: "run 3"}  # A's own stay where they are
    assert written(b.run_dir / "set_aside" / b.checkpointer.lineage / "checkpoints") == {2: "run 2", 3: "run 2"}
    assert trained(c.run_dir / "metrics.jsonl") == [(s, 1) for s in range(1, 6)] + [(6, 3)]


def test_a_checkpoint_from_before_lineages_resumes_as_a_lineage_of_its_own(tmp_path, fake_wandb):
    a, _ = process(tmp_path, 1, "total_steps=2")
    a.run()
    for _, p in checkpoints(a.run_dir / "checkpoints"):  # as relay wrote them before it recorded the lineage
        state = json.loads((p / "orchestrator.json").read_text())
        (p / "orchestrator.json").write_text(json.dumps({k: v for k, v in state.items() if k != "lineage"}))
    (a.run_dir / "lineage").unlink()
    b, _ = process(tmp_path, 2, "total_steps=4", "checkpoint.resume=auto")
    assert b.step == 2 and b.roles.learner.restored == "run 1" and b.checkpointer.lineage == LEGACY
    b.run()
    assert written(b.run_dir / "checkpoints") == {3: "run 2", 4: "run 2"}  # the old ones retired with the new
    assert not (b.run_dir / "set_aside").exists()
    assert trained(b.run_dir / "metrics.jsonl") == [(1, 1), (2, 1), (3, 2), (4, 2)]
    older = f"checkpoint.resume={b.run_dir / 'checkpoints' / 'step_3'}"
    c, _ = process(tmp_path, 3, "total_steps=4", older)  # and by path
    assert c.step == 3 and c.roles.learner.restored == "run 2"


def test_retention_never_removes_the_checkpoint_it_just_wrote(tmp_path):
    from orchestrator.loop.checkpointer import Checkpointer
    from tests.small_loop import Learner

    saver = Checkpointer(tmp_path, keep_last=1, resume="never")
    later = saver.save(9, Learner([], tag="later"), lambda: {"step": 9})  # a later one of its lineage
    saved = saver.save(1, Learner([], tag="now"), lambda: {"step": 1})
    assert saved.exists() and written(tmp_path / "checkpoints") == {1: "now"} and not later.exists()


@pytest.mark.parametrize("elsewhere", ["another name's folder", "a run set aside here"])
def test_a_run_resumed_from_outside_its_folder_goes_back_there_until_it_has_a_checkpoint_of_its_own(
    tmp_path, fake_wandb, first, capsys, elsewhere
):
    """A run resumed from a checkpoint outside its folder's checkpoints/ that ended (resumable) before it
    wrote one there: its end line said "no checkpoint was written; to start again", and resume=auto then
    started from step 0, setting the run's own records aside as "another run"."""
    a_lineage = first[0]
    if elsewhere == "a run set aside here":
        b, _ = process(tmp_path, 2, "total_steps=3")
        b.run()
        run_dir, start = b.run_dir, b.run_dir / "set_aside" / a_lineage / "checkpoints" / "step_5"
    else:
        run_dir, start = tmp_path / "other", tmp_path / "small" / "checkpoints" / "step_5"

    def process_in(n, resume):
        over = ("logging.wandb.mode=offline", "total_steps=8", f"checkpoint.resume={resume}")
        return small_trainer(tmp_path, *over, stats=STATS | {"run/tag": float(n)}, tag=f"run {n}", run_dir=run_dir)[0]

    c = process_in(3, start)  # checkpoints only at the end (every_n_steps 0, the default)
    assert c.step == 5 and c.roles.learner.restored == "run 1" and c.checkpointer.lineage == a_lineage
    c.tracker.close()  # it dies in a step before its first checkpoint
    status, line = ending(ray.exceptions.ActorDiedError(), run_dir, COMMAND)
    assert line.endswith(f"to continue from checkpoint step 5: {COMMAND}")
    capsys.readouterr()
    d = process_in(4, "auto")
    assert d.step == 5 and d.roles.learner.restored == "run 1" and d.checkpointer.lineage == a_lineage
    assert "held another run" not in capsys.readouterr().out  # its own run: nothing set aside
    d.run()
    assert written(run_dir / "checkpoints") == {8: "run 4"}
    assert trained(run_dir / "metrics.jsonl") == [(s, 1) for s in range(1, 6)] + [(6, 4), (7, 4), (8, 4)]
    _, line = ending(ray.exceptions.ActorDiedError(), run_dir, COMMAND)
    assert line.endswith(f"to continue from checkpoint step 8: {COMMAND}")
    # a fresh run then sets it aside, and says where it continues from
    capsys.readouterr()
    process_in(5, "never")
    said = capsys.readouterr().out
    assert f"held another run ({a_lineage}, checkpoints up to step_8)" in said


def test_a_set_aside_killed_midway_leaves_the_newest_checkpoint_for_resume_auto(tmp_path, monkeypatch):
    from orchestrator.loop.run_folder import _move_aside as move_aside
    from orchestrator.loop.run_folder import claim, resume_path

    run_dir = tmp_path / "run"
    held = "older-run"
    for step in (5, 2, 10, 7):  # listed in no particular order
        ckpt = run_dir / "checkpoints" / f"step_{step}"
        ckpt.mkdir(parents=True)
        (ckpt / "orchestrator.json").write_text(json.dumps({"step": step, "lineage": held}))
    (run_dir / "lineage").write_text(held + "\n")
    moved = []
    real = Path.rename

    def dies_on_the_third(self, target):
        if len(moved) == 2:
            raise KeyboardInterrupt  # the process killed between two moves
        moved.append(self.name)
        return real(self, target)

    monkeypatch.setattr(Path, "rename", dies_on_the_third)
    with pytest.raises(KeyboardInterrupt):
        move_aside(run_dir / "set_aside" / held, [p for _, p in checkpoints(run_dir / "checkpoints")][::-1], held)
    monkeypatch.undo()
    assert moved == ["step_2", "step_5"]  # oldest first
    assert resume_path("auto", run_dir).name == "step_10"  # the old run's newest: not an older one
    assert claim(run_dir, "auto")[1].name == "step_10"

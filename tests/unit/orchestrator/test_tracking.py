"""Tracker through Trainer.run's loop (on stand-in roles, no Ray): every wandb log carries its step, so
nothing of the last step is dropped; a resumed run's metrics.jsonl holds each step once."""

import json

import pytest

from orchestrator.config.schema import LoggingConfig, WandbConfig, WandbMode
from orchestrator.loop.step_metrics import finished_before
from orchestrator.loop.tracking import Tracker
from tests.helpers import jsonl_rows as rows

SAMPLES = [{"prompt": "1+1=", "policy": "2", "reward": 1.0, "reference": "3", "reference_reward": 0.0}]


class FakeWandbRun:
    """wandb's step rules: a log without a step goes to the current step and moves it on; a log to a
    step below the current one is dropped (wandb warns "Tried to log to step N that is less than...")."""

    def __init__(self, run_id, step=0, logged=None):
        self.id, self.step, self.logged, self.dropped, self.calls = run_id, step, logged or {}, [], []

    def log(self, data, step=None):
        self.calls.append((sorted(data), step))
        if step is None:
            self.logged.setdefault(self.step, {}).update(data)
            self.step += 1
        elif step < self.step:
            self.dropped.append((step, sorted(data)))
        else:
            self.step = step
            self.logged.setdefault(step, {}).update(data)

    def finish(self):
        pass


class FakeWandb:
    """wandb.init over runs kept by id, as its server keeps them: resume="allow" reattaches to a run
    of that id and goes on after its last step; resume_from="ID?_step=N" rewinds it to step N (its
    history after N is dropped, the next log must be > N: wandb 0.31's starting_step, offline too)."""

    def __init__(self):
        self.runs, self.inits = {}, []

    def init(self, id, resume=None, resume_from=None, **kwargs):
        self.inits.append({"id": id, "resume": resume, "resume_from": resume_from})
        old = self.runs.get(id)
        if resume_from is not None:
            run_id, step = resume_from.split("?_step=")
            assert run_id == id and old is not None
            kept = {s: d for s, d in old.logged.items() if s <= int(step)}
            run = FakeWandbRun(id, int(step) + 1, kept)
        elif old is not None and resume == "allow":
            run = FakeWandbRun(id, old.step + 1, old.logged)
        else:
            assert old is None, f"wandb run {id} exists"
            run = FakeWandbRun(id)
        self.runs[id] = self.run = run
        return run


def write_checkpoint(run_dir, step):
    """What a first run checkpointed at `step`, as the loop's state: a resumed run starts there. It is the
    checkpoint of the run the folder holds (its lineage file's, if a run wrote one)."""
    counts = ["data/skipped_lines", "rollout/dropped_groups", "learner/skipped_updates_in_a_row"]
    counts += ["reward/unjudged_steps_in_a_row", "restarts/rollout", "restarts/scoring", "async/dropped_stale"]
    state = {"step": step, "counters": dict.fromkeys(counts, 0), "scoring": {}, "config": {}}
    state |= {"sampler": {"epoch": 0, "position": 2 * step}, "ahead": []}
    if (run_dir / "lineage").exists():
        state["lineage"] = (run_dir / "lineage").read_text().strip()
    (run_dir / "checkpoints" / f"step_{step}").mkdir(parents=True)
    (run_dir / "checkpoints" / f"step_{step}" / "orchestrator.json").write_text(json.dumps(state))


def trainer(run_dir, total_steps, step=0, every_eval=0):
    """The real Trainer on stand-in roles (tests/small_loop.py) with a real tracker, in
    `run_dir`, resumed from the checkpoint of `step` if > 0 (written here unless a run left one).
    Every row it trains carries run/resumed."""
    from tests.small_loop import STATS, small_trainer  # imports vLLM and DeepSpeed: slow, only here

    if step and not (run_dir / "checkpoints" / f"step_{step}").exists():
        write_checkpoint(run_dir, step)
    over = [f"total_steps={total_steps}", f"eval.every_n_steps={every_eval}"]
    over += [
        "logging.wandb.mode=offline",
        "logging.progress_bar=false",
        f"checkpoint.resume={'auto' if step else 'never'}",
    ]
    stats = STATS | {"run/resumed": float(step > 0)}
    return small_trainer(run_dir, *over, stats=stats, run_dir=run_dir)[0]


def test_every_wandb_log_carries_its_step_and_the_last_image_is_kept(tmp_path, fake_wandb):
    trainer(tmp_path, total_steps=4, every_eval=2).run()
    run = fake_wandb.run
    assert run.calls and all(step is not None for _, step in run.calls), run.calls
    assert not run.dropped, run.dropped
    last = run.logged[4]
    assert last["pipeline"] == ("image", str(tmp_path / "pipeline.png"))
    assert {"eval/samples", "eval/greedy/reward/mean", "timing/total"} <= set(last)
    assert "eval/samples" in run.logged[0] and "eval/samples" in run.logged[2]


def test_a_resumed_run_holds_each_step_once(tmp_path, fake_wandb):
    # the first run checkpointed step 20, wrote steps 21-26 and died writing step 27's row
    first = [{"step": s, "timing/total": 1.0, "run/resumed": 0.0} for s in range(1, 27)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in first) + '{"step": 27, "timing/')
    tables = [{"step": s, "table": "eval/samples", "rows": SAMPLES} for s in (0, 10, 20, 25)]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tables))
    (tmp_path / "eval_before.json").write_text(json.dumps({"eval/greedy/reward/mean": 0.1}))
    trainer(tmp_path, total_steps=30, step=20).run()
    steps = [r for r in rows(tmp_path / "metrics.jsonl") if "timing/total" in r]
    assert [r["step"] for r in steps] == list(range(1, 31))
    assert [r["run/resumed"] for r in steps] == [0.0] * 20 + [1.0] * 10  # 21-26: the resumed run's rows
    assert [r["step"] for r in rows(tmp_path / "samples.jsonl")] == [0, 10, 20, 30]


def test_a_fresh_run_starts_new_files(tmp_path):
    for name in ("metrics.jsonl", "samples.jsonl"):  # an earlier run of the same name
        (tmp_path / name).write_text(json.dumps({"step": 1}) + "\n")
    tracker = Tracker(LoggingConfig(wandb=WandbConfig(mode=WandbMode.disabled)), tmp_path, "run", {}, resumed_at=None)
    tracker.log(1, {"x": 2.0}, 1)
    tracker.log_table("eval/samples", 1, SAMPLES)
    tracker.close()
    assert rows(tmp_path / "metrics.jsonl") == [{"step": 1, "x": 2.0}]
    assert rows(tmp_path / "samples.jsonl") == [{"step": 1, "table": "eval/samples", "rows": SAMPLES}]


def killed_at(tmp_path, total_steps, step):
    """A first run that logs steps 1..step, checkpointing none of them here, then dies."""
    t = trainer(tmp_path, total_steps)

    def dies(done, metrics):
        if done == step:
            raise KeyboardInterrupt("killed")

    with pytest.raises(KeyboardInterrupt):
        t.run(on_step=dies)
    t.tracker.close()


def test_a_resumed_run_rewinds_its_wandb_run_so_the_redone_steps_are_kept(tmp_path, fake_wandb):
    """Review A, item 3: the resumed run reattached with resume="allow", whose wandb step goes on
    after the first run's last (26): the redone steps 21-26 were dropped."""
    killed_at(tmp_path, total_steps=30, step=26)  # checkpointed step 20 (in this story), died in step 27
    first = fake_wandb.run.id
    assert (tmp_path / "wandb_id").read_text().strip() == first
    trainer(tmp_path, total_steps=30, step=20).run()
    run = fake_wandb.run
    assert fake_wandb.inits[-1]["resume_from"] == f"{first}?_step=20" and run.id == first
    assert not run.dropped, run.dropped
    steps = {s: d["run/resumed"] for s, d in run.logged.items() if "run/resumed" in d}
    assert steps == {s: float(s > 20) for s in range(1, 31)}  # 21-26 are the resumed run's


def test_a_fresh_run_of_the_same_name_is_a_new_wandb_run(tmp_path, fake_wandb):
    """Review A, item 3: id=name reattached a fresh run to the old wandb run and dropped its steps."""
    trainer(tmp_path, total_steps=3).run()
    trainer(tmp_path, total_steps=3).run()
    a, b = fake_wandb.inits
    assert a["id"] != b["id"] and b["resume_from"] is None and b["resume"] is None
    assert (tmp_path / "wandb_id").read_text().strip() == b["id"]
    assert not fake_wandb.run.dropped and sorted(fake_wandb.run.logged) == [0, 1, 2, 3]


def test_a_resume_wandb_cannot_rewind_logs_to_a_new_run_and_says_so(tmp_path, fake_wandb, monkeypatch, capsys):
    killed_at(tmp_path, total_steps=6, step=4)
    first, init = fake_wandb.run.id, fake_wandb.init

    def refuses_rewinds(**kwargs):
        if kwargs.get("resume_from"):
            raise RuntimeError("rewind is not enabled for this entity")
        return init(**kwargs)

    import wandb

    monkeypatch.setattr(wandb, "init", refuses_rewinds)
    trainer(tmp_path, total_steps=6, step=2).run()
    out = capsys.readouterr().out
    assert f"wandb could not rewind run {first} to step 2 (RuntimeError: rewind is not enabled" in out
    assert fake_wandb.run.id != first and f"logs to a new wandb run {fake_wandb.run.id}" in out
    assert not fake_wandb.run.dropped and sorted(fake_wandb.run.logged) == [3, 4, 5, 6]


def test_resuming_a_finished_run_logs_its_last_step_once(tmp_path, fake_wandb):
    """Review A, item 15: a finished run resumed at its last step kept its final evaluation's row
    and evaluated again: the last step twice in metrics.jsonl."""
    first = trainer(tmp_path, total_steps=4, every_eval=2).run()
    before = (tmp_path / "metrics.jsonl").read_text(), (tmp_path / "samples.jsonl").read_text()
    after = trainer(tmp_path, total_steps=4, every_eval=2, step=4).run()
    assert after == first and "eval/greedy/reward/mean" in after  # the first run's, read back
    assert ((tmp_path / "metrics.jsonl").read_text(), (tmp_path / "samples.jsonl").read_text()) == before
    assert [r["step"] for r in rows(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 4]  # step 4, then its evaluation
    assert not fake_wandb.run.dropped


def test_a_crash_after_the_final_rows_redoes_the_final_evaluation_once(tmp_path, fake_wandb):
    # the final evaluation's rows were written, eval_after.json not: the resumed run evaluates again
    trainer(tmp_path, total_steps=4, every_eval=2).run()
    (tmp_path / "eval_after.json").unlink()
    trainer(tmp_path, total_steps=4, every_eval=2, step=4).run()
    assert [r["step"] for r in rows(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 4]
    assert [r["step"] for r in rows(tmp_path / "samples.jsonl")] == [0, 2, 4]
    assert (tmp_path / "eval_after.json").exists()


def test_a_fresh_run_is_never_taken_for_a_finished_one(tmp_path, fake_wandb):
    trainer(tmp_path, total_steps=2).run()  # an earlier run of this name finished
    t = trainer(tmp_path, total_steps=2)  # a fresh one dies after its last step, before evaluating it

    def dies(step, metrics):
        if step == 2:
            raise KeyboardInterrupt("killed")

    with pytest.raises(KeyboardInterrupt):
        t.run(on_step=dies)
    assert not (tmp_path / "eval_after.json").exists()
    assert not finished_before(tmp_path, 2, 2)  # so its resume at step 2 evaluates


def test_a_resume_that_redoes_the_final_evaluation_gets_it_to_wandb(tmp_path, fake_wandb):
    """The rewind to the checkpoint's step N set wandb's next step to N + 1 (wandb 0.31, offline too), so
    the final evaluation the resumed run redoes at step N was dropped: wandb is rewound to N - 1 and step
    N's training row, kept in metrics.jsonl, logged again before it."""
    killed_at(tmp_path, total_steps=4, step=4)  # checkpointed step 4 (in this story), died in its final evaluation
    trained = fake_wandb.run.logged[4]
    trainer(tmp_path, total_steps=4, step=4).run()
    run = fake_wandb.run
    assert fake_wandb.inits[-1]["resume_from"].endswith("?_step=3")
    assert not run.dropped, run.dropped
    assert {k: run.logged[4][k] for k in trained} == trained  # the training row, as the first run logged it
    assert {"eval/greedy/reward/mean", "eval/samples", "pipeline"} <= set(run.logged[4])
    assert sorted(run.logged) == [0, 1, 2, 3, 4]
    assert [r["step"] for r in rows(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 4]

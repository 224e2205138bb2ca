"""Tracker through Trainer.run's loop (phases stubbed, no Ray): every wandb log carries its step, so
nothing of the last step is dropped; a resumed run's metrics.jsonl holds each step once."""
import json
from types import SimpleNamespace

import pytest

from orchestrator.config import LoggingConfig, WandbConfig, WandbMode
from orchestrator.tracking import Tracker

SAMPLES = [{"prompt": "1+1=", "policy": "2", "reward": 1.0, "reference": "3", "reference_reward": 0.0}]


class FakeWandbRun:
    """wandb's step rules: a log without a step goes to the current step and moves it on; a log to a
    step below the current one is dropped (wandb warns "Tried to log to step N that is less than...")."""

    def __init__(self):
        self.step, self.logged, self.dropped, self.calls = 0, {}, [], []

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


@pytest.fixture
def fake_wandb(monkeypatch):
    import wandb

    run = FakeWandbRun()
    monkeypatch.setattr(wandb, "init", lambda **kwargs: run)
    monkeypatch.setattr(wandb, "Table", lambda columns, data: ("table", columns, data))
    monkeypatch.setattr(wandb, "Image", lambda path: ("image", path))
    return run


def trainer(tmp_path, total_steps, step=0, every_eval=0):
    """A Trainer whose phases are stubs and whose tracker is real, at `step` (a resumed run: > 0)."""
    from orchestrator.trainer import Trainer  # imports vLLM and DeepSpeed: slow, only here

    t = object.__new__(Trainer)
    t.cfg = SimpleNamespace(total_steps=total_steps, eval=SimpleNamespace(every_n_steps=every_eval),
                            checkpoint=SimpleNamespace(every_n_steps=0))
    t.step, t.run_dir, t.samples = step, tmp_path, SAMPLES
    t.channel = SimpleNamespace(settle=lambda: None)
    t._write_json = lambda name, data: (tmp_path / name).write_text(json.dumps(data))
    t.evaluate = lambda: {"eval/greedy_accuracy": 0.5}
    t.train_step = lambda: {"timing/total": 1.0, "run/resumed": float(step > 0)}
    t.save = lambda: None
    logging = LoggingConfig(wandb=WandbConfig(mode=WandbMode.offline), progress_bar=False)
    t.tracker = Tracker(logging, tmp_path, "run", {}, resumed_at=step if step else None)
    return t


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_wandb_log_carries_its_step_and_the_last_image_is_kept(tmp_path, fake_wandb):
    trainer(tmp_path, total_steps=4, every_eval=2).run()
    assert fake_wandb.calls and all(step is not None for _, step in fake_wandb.calls), fake_wandb.calls
    assert not fake_wandb.dropped, fake_wandb.dropped
    last = fake_wandb.logged[4]
    assert last["pipeline"] == ("image", str(tmp_path / "pipeline.png"))
    assert {"eval/samples", "eval/greedy_accuracy", "timing/total"} <= set(last)
    assert "eval/samples" in fake_wandb.logged[0] and "eval/samples" in fake_wandb.logged[2]


def test_a_resumed_run_holds_each_step_once(tmp_path, fake_wandb):
    # the first run checkpointed step 20, wrote steps 21-26 and died writing step 27's row
    first = [{"step": s, "timing/total": 1.0, "run/resumed": 0.0} for s in range(1, 27)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in first) + '{"step": 27, "timing/')
    tables = [{"step": s, "table": "eval/samples", "rows": SAMPLES} for s in (0, 10, 20, 25)]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tables))
    (tmp_path / "eval_before.json").write_text(json.dumps({"eval/greedy_accuracy": 0.1}))
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

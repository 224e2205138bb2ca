"""The run's checkpoints under runs/<name>/checkpoints: written whole, published, the oldest removed."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

from learner.checkpoint import publish
from orchestrator.loop.step_metrics import checkpoints, resume_path


class Checkpointer:
    """Owns the checkpoint folder: step_N/learner (the learner's own files) and step_N/orchestrator.json
    (the loop's state), the retention of the last checkpoint.keep_last, which one to resume from, and the
    last one this run saved or resumed from (what a learner recovery goes back to)."""

    def __init__(self, run_dir: Path, keep_last: int, resume: str):
        self.root = run_dir / "checkpoints"
        self.keep_last = keep_last
        self.resume_from = resume_path(resume, self.root)  # None: a fresh start
        self.last = self.resume_from

    def path(self, step: int) -> Path:
        return self.root / f"step_{step}"

    def save(self, step: int, learner, loop_state: Callable[[], dict]) -> Path:
        """step_N, written as step_N.tmp: the learner's files, then `loop_state()`; then published
        (learner.checkpoint.publish: a step_N already there is replaced only once the new one is
        complete); then the oldest beyond keep_last removed."""
        final, tmp = self.path(step), self.root / f"step_{step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        learner.save(tmp / "learner")
        (tmp / "orchestrator.json").write_text(json.dumps(loop_state()))
        publish(tmp, final)
        for _, old in checkpoints(self.root)[: -self.keep_last]:
            shutil.rmtree(old)
        self.last = final
        return final

    def load(self, learner, path: Path) -> dict:
        """The loop's state of checkpoint `path` (resume_from, or one this run saved), the learner restored from it."""
        state = json.loads((path / "orchestrator.json").read_text())
        learner.load(path / "learner")
        return state

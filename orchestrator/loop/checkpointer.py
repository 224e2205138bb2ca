"""The run's checkpoints under runs/<name>/checkpoints: written whole, published, the oldest removed."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

from learner.checkpoint import publish
from orchestrator.loop.run_folder import checkpoints, claim


class Checkpointer:
    """Owns the checkpoint folder: step_N/learner (the learner's own files) and step_N/orchestrator.json
    (the loop's state and the run's lineage), the retention of the last checkpoint.keep_last, which one to
    resume from, and the last one this run saved or resumed from (what a learner recovery goes back to).
    Only this run's lineage counts (orchestrator/loop/run_folder.py): a fresh run has a new one, a resumed
    run keeps its checkpoint's, and the folder's other run, or the branch a resume leaves, is set aside first."""

    def __init__(self, run_dir: Path, keep_last: int, resume: str):
        self.root = run_dir / "checkpoints"
        self.keep_last = keep_last
        self.lineage, self.resume_from = claim(run_dir, resume)  # resume_from None: a fresh start
        self.last = self.resume_from

    def path(self, step: int) -> Path:
        return self.root / f"step_{step}"

    def save(self, step: int, learner, loop_state: Callable[[], dict]) -> Path:
        """step_N, written as step_N.tmp: the learner's files, then `loop_state()` with the lineage; then
        published (learner.checkpoint.publish: a step_N already there is replaced only once the new one
        is complete); then this lineage's oldest beyond keep_last removed, never the one just written."""
        final, tmp = self.path(step), self.root / f"step_{step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        learner.save(tmp / "learner")
        (tmp / "orchestrator.json").write_text(json.dumps(loop_state() | {"lineage": self.lineage}))
        publish(tmp, final)
        if self.keep_last:  # the one just written counts as the newest, whatever its step
            others = [p for _, p in checkpoints(self.root, self.lineage) if p != final]
            for old in others[: max(len(others) - (self.keep_last - 1), 0)]:
                shutil.rmtree(old)
        self.last = final
        return final

    def load(self, learner, path: Path) -> dict:
        """The loop's state of checkpoint `path` (resume_from, or one this run saved), the learner restored from it."""
        state = json.loads((path / "orchestrator.json").read_text())
        learner.load(path / "learner")
        return state

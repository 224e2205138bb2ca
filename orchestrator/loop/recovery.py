"""What a learner recovery (Trainer.recover_learner) restores and how it gives up: the counts that go on
after a restore, and LearnerLost, the end of a run whose learner died more often than cluster.max_restarts."""

from __future__ import annotations

import os

RESTARTS = "restarts/"  # the counts of restarts: what happened, which no restore undoes


def restored_counters(now: dict, saved: dict, in_process: bool) -> dict:
    """The counts to go on with after restoring a checkpoint whose counts are `saved`, `now` being the
    loop's current ones: the checkpoint's (a count it lacks, as an older relay's checkpoint lacks a newer
    one, keeps its current value), except, `in_process` (a learner recovery), the restarts: the
    replayed steps do not undo the restarts that happened. A resumed run takes the checkpoint's restarts."""
    kept = {k: v for k, v in now.items() if k not in saved or (in_process and k.startswith(RESTARTS))}
    return saved | kept


class LearnerLost(RuntimeError):
    """The learner died once more than cluster.max_restarts allows, in step `step` + 1; the run is
    resumable from `checkpoint`, its last (None: it had none, so checkpoint.resume=auto starts anew)."""

    def __init__(
        self, restarts: int, step: int, checkpoint: os.PathLike | None, cause: BaseException, replayable: bool = True
    ):
        self.restarts, self.step, self.checkpoint = restarts, step, checkpoint
        where = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint (a resumed run starts from step 0)"
        why = (
            f"after {restarts} learner restarts (cluster.max_restarts: {restarts})"
            if replayable
            else "with the agent endpoint, whose episodes cannot be replayed in process"
        )
        super().__init__(
            f"a learner rank died in step {step + 1} ({type(cause).__name__}) {why}; the run's last is {where}"
        )

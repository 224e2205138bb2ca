"""A learner rebuilt without ending the run (LearnerRecovery), and LearnerLost, the end of a run whose
learner died more often than cluster.max_restarts."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

import ray

from orchestrator.loop.checkpointer import Checkpointer
from orchestrator.loop.loop_state import LoopState
from runtime import watchdog


class LearnerRecovery:
    """Owns what a dead learner goes back to, the last checkpoint this run saved or resumed from (or, with
    none, the loop's state at a fresh start), and how often this process rebuilt it, against
    cluster.max_restarts (a resume starts the count afresh; Ray's engine budget is the same number)."""

    def __init__(
        self, roles, state: LoopState, checkpointer: Checkpointer, tracker, max_restarts: int, start: dict | None
    ):
        """start: the loop's state at a fresh start (None: a resumed run, which has a checkpoint to go back to)."""
        self.roles, self.state, self.checkpointer, self.tracker = roles, state, checkpointer, tracker
        self.max_restarts = max_restarts
        self.rebuilds = 0
        self.start = None if start is None else json.dumps(start)  # a copy: the loop's state moves on

    def recover(self, loop_step: Callable[[], int], error: Exception, replayable: bool) -> None:
        """A learner rank died (or the watchdog killed a stuck one; `error` says which) in the step after
        the loop's: start every rank again, restore the last checkpoint in process as a resumed run would
        (LoopState moves the loop to its step), and rewind the records (metrics.jsonl, samples.jsonl,
        wandb) to it; the loop replays the steps after it. Beyond max_restarts rebuilds, or with the
        endpoint's episodes, which cannot be replayed (a resumed run, whose endpoint starts empty, samples
        them anew from the restored policy): the tracker closed, LearnerLost (resumable)."""
        while True:
            step = loop_step()
            if self.rebuilds >= self.max_restarts or not replayable:
                self.tracker.close()
                raise LearnerLost(self.rebuilds, step, self.checkpointer.last, error, replayable) from error
            self.rebuilds += 1
            began = time.perf_counter()
            print(
                f"relay: a learner rank died in step {step + 1} ({type(error).__name__}); restarting the "
                f"learner ({self.rebuilds}/{self.max_restarts})",
                flush=True,
            )
            try:
                with watchdog.phase("recover"):
                    self.roles.restart_learner()
                    restored = self._restore_last()
                    self.tracker.rewind(restored)
            except ray.exceptions.RayActorError as e:
                if self.roles.rollout.lost(e):
                    raise
                error = e  # a new rank died too (its handle may not be the group's yet): again, within the limit
                continue
            took = time.perf_counter() - began
            print(f"relay: learner restored at step {restored} in {took:.1f}s; going on from there", flush=True)
            return

    def _restore_last(self) -> int:
        """The last checkpoint (or the start) back in the loop, its counts but the restarts; returns its step."""
        if self.checkpointer.last is not None:
            state = self.checkpointer.load(self.roles.learner, self.checkpointer.last)
        else:  # the ranks were built anew from the model: the learner is at the start already
            state = json.loads(self.start)
        return self.state.load_state_dict(state, in_process=True)


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

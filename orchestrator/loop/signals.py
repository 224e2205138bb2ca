"""Stopping a run cleanly on SIGTERM (Slurm preemption, Kubernetes eviction, `ray job stop`) or
SIGINT (Ctrl-C): the handler only records the request; the loop reads it between steps, finishes
the step in flight, checkpoints it and raises Stopped, which the CLI turns into exit status 3."""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager
from typing import Iterator

STOPPED_EXIT_CODE = 3  # stopped by a signal, checkpoint written: resumable (Slurm recipe requeues on it)
INTERRUPTED_EXIT_CODE = 130  # a second Ctrl-C: exited at once, no checkpoint (128 + SIGINT, the shell's convention)


class StopRequest:
    """Whether (and by which signal) the run was asked to stop. Plain state: tests and library
    callers can set it with request() instead of sending a signal."""

    def __init__(self) -> None:
        self.signal: str | None = None

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def request(self, name: str) -> None:
        self.signal = self.signal or name  # the first signal names the stop


class Stopped(Exception):
    """The loop stopped on request after `step` completed steps; `checkpoint` holds them (None: no
    step had completed, so resuming starts from scratch)."""

    def __init__(self, signal_name: str, step: int, total_steps: int, checkpoint: os.PathLike | None):
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint
        saved = (
            f"checkpoint {checkpoint}; checkpoint.resume=auto continues from it"
            if checkpoint
            else "no step had completed, nothing to save"
        )
        super().__init__(f"stopped by {signal_name} after step {step}/{total_steps}; {saved}")


@contextmanager
def stop_on_signals(request: StopRequest, signals=(signal.SIGTERM, signal.SIGINT)) -> Iterator[StopRequest]:
    """Within the block, SIGTERM and SIGINT set `request` instead of killing the process; the old
    handlers come back on exit. A SIGINT after a stop was requested raises KeyboardInterrupt (the
    impatient Ctrl-C: exit now, no checkpoint). A repeated SIGTERM does not: schedulers send it to
    several processes of a job, and a wrapper script may forward it again."""

    def handler(signum, frame):
        name = signal.Signals(signum).name
        if request.requested and signum == signal.SIGINT:
            _say(f"relay: {name} again: exiting now, without a checkpoint")
            raise KeyboardInterrupt
        if not request.requested:
            _say(
                f"relay: {name} received: finishing the current step, then writing a checkpoint and exiting "
                f"(Ctrl-C again to exit now, without one)"
            )
        request.request(name)

    old = {s: signal.signal(s, handler) for s in signals}  # ValueError outside the main thread
    try:
        yield request
    finally:
        for s, h in old.items():
            signal.signal(s, signal.SIG_DFL if h is None else h)  # None: it was set outside Python


def _say(text: str) -> None:
    # os.write, not print: a handler can run while the main thread is inside a print to the same
    # buffered stream, and the buffer refuses a re-entrant write
    os.write(2, (text + "\n").encode())

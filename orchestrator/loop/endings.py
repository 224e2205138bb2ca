"""How a failed run ends: its exit status, its cause in one line, and the command that continues it; the
raw traceback goes to the run folder's relay.log, not the terminal."""

from __future__ import annotations

import re
import time
import traceback
from pathlib import Path

import ray

from orchestrator.loop.run_folder import run_checkpoints
from orchestrator.loop.signals import STOPPED_EXIT_CODE
from runtime.watchdog import RunHung

FAILED_EXIT_CODE = 1


def resumable(error: BaseException) -> bool:
    """A run that ended because a process is gone or stuck past its restarts (not because of what it
    computed): its checkpoints are intact, and the same command with checkpoint.resume=auto goes on."""
    from orchestrator.loop.recovery import LearnerLost
    from rollout.members import EnginesLost
    from rollout.weight_sync import SyncFailed

    lost_peer = isinstance(error, ray.exceptions.RayTaskError) and isinstance(error.cause, SyncFailed)
    return lost_peer or isinstance(error, (RunHung, LearnerLost, EnginesLost, ray.exceptions.RayActorError))


def cause(error: BaseException) -> str:
    """The error in one line: a dead actor's class and Ray's reason, a remote error's own type and message."""
    if isinstance(error, ray.exceptions.RayTaskError):
        inner = error.cause if error.cause is not None else error
        # a RayTaskError(DistNetworkError) and its kin delegate attributes to the cause, which has no function_name
        where = vars(error).get("function_name") or getattr(inner, "function_name", "a Ray task")
        return f"{type(inner).__name__} in {where}: {_first_line(inner)}"
    if isinstance(error, ray.exceptions.RayActorError):
        found = re.search(r"class_name: (\S+)", str(error))
        reason = " ".join(line.strip() for line in str(error).splitlines() if "because" in line)
        return f"a {found.group(1) if found else 'Ray'} actor died" + (f" ({reason})" if reason else "")
    return f"{type(error).__name__}: {_first_line(error)}"


def _first_line(error: BaseException) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[0].strip() if lines else "(no message)"


def ending(error: BaseException, run_dir: Path, resume_command: str) -> tuple[int, str]:
    """Exit status and the line to print for `error`, which ended the run in `run_dir`; its traceback is
    appended to run_dir/relay.log. The checkpoints named are the run's own (its lineage's), never another
    run's of the same name."""
    log = write_traceback(error, run_dir)
    found = run_checkpoints(run_dir)
    if resumable(error):
        go_on = (
            f"to continue from checkpoint step {found[-1][0]}: {resume_command}"
            if found
            else f"no checkpoint was written; to start again: {resume_command}"
        )
        return STOPPED_EXIT_CODE, f"relay: run ended: {cause(error)} (traceback in {log}); {go_on}"
    last = f"; the last checkpoint is step {found[-1][0]}" if found else ""
    return FAILED_EXIT_CODE, f"relay: training failed: {cause(error)} (traceback in {log}){last}"


def write_traceback(error: BaseException, run_dir: Path) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "relay.log"
    with log.open("a") as f:
        f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} the run ended with:\n")
        f.write("".join(traceback.format_exception(error)))
    return log

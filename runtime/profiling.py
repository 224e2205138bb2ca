"""Profile one call per role: torch.profiler (op times and a Chrome trace, `chrome://tracing` or
Perfetto) and cProfile (Python time: schedulers, serialisation, bookkeeping, which a small model
on a CPU spends most of its step in). The trainer switches every role on for one step
(logging.profile_step, `relay train --profile`); each writes its trace where it runs and returns
its tables to the driver, which writes runs/<name>/profile/.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time
from contextlib import contextmanager

import torch


class Profiler:
    """One profiled span of a process: a torch.profiler and a cProfile run together, started and stopped."""

    def __init__(self):
        self.ops: torch.profiler.profile | None = None
        self.python: cProfile.Profile | None = None

    def start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.ops = torch.profiler.profile(activities=activities)
        self.ops.__enter__()
        self.python = cProfile.Profile()
        self.python.enable()

    def stop(self, trace_path: str = "") -> str:
        """Stop; write the Chrome trace to trace_path (if given); return the two tables as text."""
        if self.ops is None or self.python is None:
            raise RuntimeError("Profiler.stop() without start()")
        self.python.disable()
        self.ops.__exit__(None, None, None)
        if trace_path:
            self.ops.export_chrome_trace(trace_path)
        ops = self.ops.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
        out = io.StringIO()
        pstats.Stats(self.python, stream=out).sort_stats("tottime").print_stats(25)
        self.ops = self.python = None
        return f"== torch ops (self CPU time)\n{ops}\n== Python (cProfile, by own time)\n{out.getvalue()}"


class Profiled:
    """Mixin for a role's actor class: profile(True) before the step's calls, profile(False, path) after."""

    _profiler: Profiler | None = None

    def profile(self, on: bool, trace_path: str = "") -> str:
        if on:
            self._profiler = Profiler()
            self._profiler.start()
            return ""
        text = self._profiler.stop(trace_path) if self._profiler else ""
        self._profiler = None
        return text


class Busy:
    """Mixin: how long a role has spent working, readable while it works (an actor serves
    busy_seconds from a concurrency group of its own, so the call does not queue behind the work).
    The trainer turns it into each role's busy and idle share of a step."""

    _busy_total = 0.0
    _busy_since: float | None = None  # the start of the current busy span: calls may overlap (an async actor)
    _busy_calls = 0
    _threads = 0  # torch threads the actor set up (keep_threads), for every thread it works in

    def keep_threads(self, threads: int = 0) -> None:
        """Call at the end of __init__ with the threads the role was given (0: what __init__ left set).
        An actor with a concurrency group runs its methods in threads of Ray's, and OpenMP keeps its
        thread count per calling thread: a method would compute on OMP_NUM_THREADS (1 under Ray), not
        on the role's threads. (vLLM's CPU worker sets torch to every core it binds, whatever it was given.)"""
        self._threads = threads or torch.get_num_threads()

    @contextmanager
    def working(self):
        if self._threads:
            torch.set_num_threads(self._threads)
        if self._busy_calls == 0:
            self._busy_since = time.monotonic()
        self._busy_calls += 1
        try:
            yield
        finally:
            self._busy_calls -= 1
            if self._busy_calls == 0:
                self._busy_total += time.monotonic() - self._busy_since
                self._busy_since = None

    def busy_seconds(self) -> float:
        since = self._busy_since
        return self._busy_total + (time.monotonic() - since if since is not None else 0.0)

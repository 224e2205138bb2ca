"""The driver's watchdog: a deadline on every wait for a remote call, so a run never hangs in silence.

Every role's pool waits through `get` (a drop-in for ray.get). Inside a watched phase (Watchdog.phase:
generate, score, update, sync, ...) the wait ends at that phase's deadline, which comes from the
phase's own measured durations (PhaseClock). When it passes, the watchdog names the stuck actors in one
line (phase, role, actor, node, pid, how long it waited), writes an incident folder under the run
folder (runtime/incidents.py) and acts by role: a rollout or scoring actor is killed with Ray's restart
(the pools' restart paths then recover, counted), the learner's ranks are killed (the loop rebuilds
them). The wait then ends with Ray's error for the killed actors, which the callers already handle.
Outside a Watchdog's scope (tools, tests of one role) `get` is plain ray.get.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import ray

from runtime.incidents import ActorProcess, Incident, actor_process, incident_number

log = logging.getLogger(__name__)


@dataclass
class WatchdogConfig:
    """The `watchdog` section: the deadline of each phase's waits on remote calls, and what a stuck one
    leaves behind (see runtime/watchdog.py)."""

    enabled: bool = True
    """false: wait on remote calls without deadlines (a hung actor then hangs the run)"""
    factor: float = 5.0
    """a phase's deadline: this many times the larger p99 of its own durations and of the whole step's
    (the last 100 each: a phase that waits for work launched ahead may have to wait for all of it)"""
    floor_s: float = 120.0
    """the shortest deadline a measured phase gets: a slow step is not a false alarm"""
    first_s: float = 900.0
    """the deadline of a phase not measured yet (start-up, the first step's compilation and warm-up), of the
    waits after a recovery (an engine restarted, batches generated again) and of a wait outside any phase"""
    phases_s: dict[str, float] = field(default_factory=dict)
    """fixed deadlines that replace the measured ones, by phase, e.g. {sync: 300, evaluate: 900}"""
    kill_grace_s: float = 120.0
    """after killing a stuck actor, how long to wait for Ray to report it gone before giving up the run"""
    collective_timeout_s: float = 1800.0
    """timeout of the gloo/NCCL process groups (learner ranks, weight sync): no collective waits longer.
    Every deadline stays under 0.9 of it, so the watchdog names a stuck rank before a collective fails"""
    stacks: bool = True
    """write every role's Python stacks (py-spy) into the incident folder"""


class PhaseClock:
    """Owns each phase's measured durations (the last 100) and the deadline they give (WatchdogConfig)."""

    def __init__(self, cfg: WatchdogConfig):
        self.cfg = cfg
        self.seconds: dict[str, deque[float]] = defaultdict(lambda: deque(maxlen=100))

    def record(self, phase: str, seconds: float) -> None:
        self.seconds[phase].append(seconds)

    def deadline(self, phase: str, disturbed: bool = False) -> float:
        """A fixed one (phases_s), first_s unmeasured or after a recovery (disturbed), else factor x the
        larger p99 of the phase and of the step, at least floor_s; under 0.9 x the collective timeout."""
        if phase in self.cfg.phases_s:
            return self.cfg.phases_s[phase]
        if not self.seconds[phase] or disturbed:
            return min(self.cfg.first_s, 0.9 * self.cfg.collective_timeout_s)
        p99 = max(_p99(self.seconds[phase]), _p99(self.seconds.get(STEP, ())))
        return min(max(self.cfg.floor_s, self.cfg.factor * p99), 0.9 * self.cfg.collective_timeout_s)


STEP = "step"  # the phase of a whole training step (the trainer's timing/total)
# every phase the driver watches: the trainer's timed phases, the waits around them, start-up and recovery
PHASES = {STEP, "start", "generate", "score", "reference", "dynamic_sampling", "score_ahead", "advantages", "update"}
PHASES |= {"sync", "kl", "busy", "sleep", "wake", "evaluate", "checkpoint", "recover"}


def _p99(durations) -> float:
    measured = sorted(durations)
    return measured[min(len(measured) - 1, round(0.99 * (len(measured) - 1)))] if measured else 0.0


class RunHung(RuntimeError):
    """A stuck wait the watchdog could not end (its actors did not go when killed); `incident` names it."""

    def __init__(self, incident: Incident):
        self.incident = incident
        super().__init__(f"{incident.line()}; they did not stop when killed")


@dataclass
class Watched:
    """The phase being watched: its name, when it started, and whether a recovery disturbed it (its
    duration then says nothing about the next deadline)."""

    name: str
    started: float
    disturbed: bool = False


class Watchdog:
    """Owns the deadlines of the driver's waits (a PhaseClock), the phase being watched and the
    incidents so far. `roles()`: every actor by role name (Roles.actors); `incident_context()`: what an
    incident folder keeps beside the stacks (step, last metrics, config); `run_dir`: where they go."""

    def __init__(self, cfg: WatchdogConfig, run_dir, roles: Callable[[], dict], incident_context: Callable[[], dict]):
        self.cfg, self.run_dir, self.roles, self.incident_context = cfg, run_dir, roles, incident_context
        self.clock = PhaseClock(cfg)
        self.stack: list[Watched] = []  # the phases being watched, innermost last
        self.incidents: list[Incident] = []

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Watch the block's waits under phase `name`'s deadline; its duration is measured for the next.
        A phase inside another (the checkpoint inside the last step) keeps its own deadline, then the outer's."""
        self.stack.append(Watched(name, time.monotonic()))
        try:
            yield
            if not self.stack[-1].disturbed:
                self.clock.record(name, time.monotonic() - self.stack[-1].started)
        finally:
            self.stack.pop()

    @property
    def watched(self) -> Watched | None:
        return self.stack[-1] if self.stack else None

    def restart_deadlines(self) -> None:
        """A recovery took the watched phases' time: each starts a fresh deadline, and goes unmeasured."""
        for w in self.stack:
            w.started, w.disturbed = time.monotonic(), True

    def get(self, refs, what: str = ""):
        """ray.get(refs) by the watched phase's deadline. Past it: name the stuck actors, write the
        incident, kill them (by role), restart the phase's clock, and wait for Ray's answer."""
        if not self.cfg.enabled:
            return ray.get(refs)
        w = self.watched or Watched("outside a phase", time.monotonic(), disturbed=True)  # first_s then
        limit = self.clock.deadline(w.name, w.disturbed)
        try:
            return ray.get(refs, timeout=max(0.0, limit - (time.monotonic() - w.started)))
        except ray.exceptions.GetTimeoutError:
            pending = [r for r in (refs if isinstance(refs, list) else [refs]) if not _ready(r)]
            incident = self.stuck(w.name, time.monotonic() - w.started, limit, pending, what)
        self.restart_deadlines()  # the recovery's own waits start a fresh deadline
        try:
            return ray.get(refs, timeout=self.cfg.kill_grace_s)
        except ray.exceptions.GetTimeoutError:
            raise RunHung(incident) from None

    def stuck(self, phase: str, waited: float, limit: float, pending: list, what: str) -> Incident:
        """Name the actors behind `pending`, write the incident, say it in one line, kill the culprits."""
        processes = self.processes()
        waiting = {p.actor_id for r in pending if (p := processes.get(_actor_of(r))) is not None}
        culprits = blame([processes[a] for a in waiting])
        if any(p.is_learner for p in culprits):  # the ranks restart together: one left would wait in a collective
            culprits += [p for p in processes.values() if p.is_learner and p not in culprits]
        incident = Incident(phase, what, waited, limit, culprits, incident_number(self.run_dir))
        self.incidents.append(incident)
        try:
            folder = incident.write(self.run_dir, list(processes.values()), self.incident_context(), self.cfg.stacks)
        except Exception as e:  # noqa: BLE001 (a full disk must not keep the stuck actor alive)
            folder = f"not written ({type(e).__name__}: {e})"
        _say(f"relay: {incident.line()}; incident: {folder}; {incident.action()}")
        for p in culprits:
            log.warning("watchdog: killing %s (%s, pid %d): %s", p.role, p.actor_class, p.pid, incident.action())
            ray.kill(p.handle, no_restart=not p.restartable)
        return incident

    def processes(self) -> dict[str, ActorProcess]:
        """Every role's actor by its Ray actor id, with its node, pid and process state."""
        return {h._actor_id.hex(): actor_process(role, h) for role, h in self.roles().items()}


def blame(stuck: list[ActorProcess]) -> list[ActorProcess]:
    """Which of the actors a wait is stuck on to act on: those whose process is stopped (SIGSTOP, a
    debugger), else the rollout and scoring actors (a learner in a weight sync only waits for its
    receivers), else the learner ranks: all of them, as they restart together."""
    for chosen in (
        [p for p in stuck if p.stopped],
        [p for p in stuck if not p.is_learner],
        [p for p in stuck if p.is_learner],
    ):
        if chosen:
            return chosen
    return []


def _ready(ref) -> bool:
    return bool(ray.wait([ref], timeout=0)[0])


def _actor_of(ref) -> str:
    return ref.task_id().actor_id().hex()


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


_active: Watchdog | None = None


@contextmanager
def watching(watchdog: Watchdog | None) -> Iterator[Watchdog | None]:
    """Within the block, `get` waits by `watchdog`'s deadlines (None: plain ray.get)."""
    global _active
    outer, _active = _active, watchdog
    try:
        yield watchdog
    finally:
        _active = outer


def get(refs, what: str = ""):
    """ray.get(refs), under the active watchdog's deadline if one is watching (see the module docstring).
    `what`: the call, named in an incident (e.g. "RolloutWorker.generate")."""
    return _active.get(refs, what) if _active is not None else ray.get(refs)


def restart_deadline() -> None:
    """A recovery (an actor restarted, a group rebuilt) took part of the watched phase's time: the phase's
    waits start a fresh deadline, and its duration is not measured."""
    if _active is not None:
        _active.restart_deadlines()


def phase(name: str):
    """The active watchdog's phase `name` (a no-op without one): for code that does not hold the watchdog."""
    return _active.phase(name) if _active is not None else _no_phase()


@contextmanager
def _no_phase() -> Iterator[None]:
    yield

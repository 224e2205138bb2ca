"""What the watchdog (runtime/watchdog.py) knows of a stuck wait, and the incident folder it writes:
<run>/incidents/<n>_<phase>/ with incident.json (phase, waited, the stuck actors and what was done),
stacks/<role>.txt (every role's Python stacks, by py-spy, which reads a stopped process too),
ray_status.txt, last_metrics.json and config.json."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import ray


@dataclass
class ActorProcess:
    """One role's actor as the GCS knows it: its handle and Ray id, class, node and pid, Ray's state of
    it (ALIVE, RESTARTING, DEAD), and whether its process is stopped (state T: SIGSTOP, a debugger),
    which only a process on the driver's node shows."""

    role: str
    handle: object = field(repr=False)
    actor_id: str
    actor_class: str
    node_ip: str
    node_id: str
    pid: int
    state: str
    stopped: bool

    @property
    def is_learner(self) -> bool:
        return self.role.startswith("learner")

    @property
    def restartable(self) -> bool:
        """Ray restarts a killed rollout or scoring actor (cluster.max_restarts); the loop rebuilds the learner."""
        return not self.is_learner

    def describe(self) -> str:
        stopped = ", stopped" if self.stopped else ""
        return f"{self.role} ({self.actor_class}, node {self.node_ip}, pid {self.pid}{stopped})"


def actor_process(role: str, handle) -> ActorProcess:
    actor_id = handle._actor_id.hex()
    info = ray._private.state.actors(actor_id) or {}
    address, pid = info.get("Address") or {}, int(info.get("Pid") or 0)
    node_id = address.get("NodeID", "")
    here = node_id == ray.get_runtime_context().get_node_id()
    return ActorProcess(
        role,
        handle,
        actor_id,
        info.get("ActorClassName", "?"),
        address.get("IPAddress", "?"),
        node_id,
        pid,
        info.get("State", "?"),
        here and process_state(pid) == "T",
    )


def incident_number(run_dir) -> int:
    """The next incident's number in the run folder: a resumed run goes on from the earlier run's."""
    folder = Path(run_dir) / "incidents"
    numbers = [int(p.name.split("_", 1)[0]) for p in folder.glob("*_*") if p.name.split("_", 1)[0].isdigit()]
    return max(numbers, default=0) + 1


def process_state(pid: int) -> str:
    """The kernel's one-letter state of a local process (R, S, D, T, Z), "" if unknown."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


@dataclass
class Incident:
    """A wait that passed its deadline: the phase, the call (if named), how long it waited and the
    deadline, the actors acted on (runtime.watchdog.blame), and its number in the run."""

    phase: str
    what: str
    waited_s: float
    deadline_s: float
    culprits: list[ActorProcess]
    number: int

    def line(self) -> str:
        stuck = ", ".join(p.describe() for p in self.culprits) or "no role's actor (a task of the driver's)"
        call = f" in {self.what}" if self.what else ""
        return (
            f"watchdog: phase {self.phase}{call} waited {self.waited_s:.0f} s (deadline {self.deadline_s:.0f} s) "
            f"on {stuck}"
        )

    def action(self) -> str:
        if not self.culprits:
            return "nothing to restart"
        if any(p.is_learner for p in self.culprits):
            return "killing the learner ranks: the run rebuilds them from its last checkpoint"
        return "killing it: Ray restarts it (cluster.max_restarts) and its work is redone"

    def write(self, run_dir, every_role: list[ActorProcess], context: dict, stacks: bool) -> Path:
        """The incident folder: this incident, every role's stacks, `ray status`, `context`'s last
        metrics and config. Each part is best effort: a failing one writes its error instead."""
        folder = Path(run_dir) / "incidents" / f"{self.number}_{self.phase}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "incident.json").write_text(json.dumps(self.summary(context.get("step")), indent=1))
        for key in ("last_metrics", "config"):
            (folder / f"{key}.json").write_text(json.dumps(context.get(key), indent=1, default=str))
        if stacks:
            (folder / "stacks").mkdir(exist_ok=True)
            for p in every_role:
                (folder / "stacks" / f"{p.role}.txt").write_text(f"{p.describe()}, Ray state {p.state}\n\n{stack(p)}")
        (folder / "ray_status.txt").write_text(_run([_ray_cli(), "status"]))
        return folder

    def summary(self, step) -> dict:
        return {
            "step": step,
            "phase": self.phase,
            "call": self.what,
            "waited_s": round(self.waited_s, 1),
            "deadline_s": round(self.deadline_s, 1),
            "stuck": [
                {"role": p.role, "class": p.actor_class, "node": p.node_ip, "pid": p.pid, "stopped": p.stopped}
                for p in self.culprits
            ],
            "action": self.action(),
            "line": self.line(),
        }


def stack(p: ActorProcess) -> str:
    """The actor's Python stacks by py-spy (--nonblocking: a stopped process is read, not waited for), run
    here for an actor on the driver's node, else by a task pinned to the actor's node."""
    if not p.pid:
        return "no process (Ray reports none)"
    if p.node_id == ray.get_runtime_context().get_node_id():
        return py_spy_dump(p.pid)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(py_spy_dump).options(
        num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(p.node_id, False)
    )
    try:
        return ray.get(task.remote(p.pid), timeout=60)
    except Exception as e:  # noqa: BLE001 (the node may be the thing that is gone)
        return f"could not read the stacks on node {p.node_ip}: {type(e).__name__}: {e}"


def py_spy_dump(pid: int) -> str:
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    return _run([spy, "dump", "--pid", str(pid), "--nonblocking"])


def _ray_cli() -> str:
    return shutil.which("ray") or str(Path(sys.executable).with_name("ray"))


def _run(command: list[str], timeout_s: float = 60.0) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        return done.stdout + (f"\n[stderr]\n{done.stderr}" if done.stderr.strip() else "")
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{' '.join(command)} failed: {type(e).__name__}: {e}"

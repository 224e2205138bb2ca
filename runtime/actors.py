"""Helpers for a role's Ray actors: the options one is started with, waiting until restarted ones
answer, and reading each one's busy time while it works. Every role's pool uses them."""

from __future__ import annotations

import time
from collections.abc import Callable

import ray

from runtime import watchdog

GONE_POLL_S = 2.0  # how often await_ready asks whether an actor that does not answer has lost its node


def actor_options(
    num_cpus: float, num_gpus: float, max_restarts: int, env: dict[str, str], resources: dict[str, float] | None = None
) -> dict:
    """Ray options of one actor: its CPUs and GPUs, how often Ray restarts it, its environment
    variables, and `resources`: custom Ray resources it requires (placement knobs)."""
    return dict(
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        max_restarts=max_restarts,
        runtime_env={"env_vars": env},
        resources=dict(resources or {}),
        name=None,
    )


def busy_seconds(actors: list) -> list[float]:
    """Each Busy actor's working seconds since it (re)started, answered while it works; 0 for an
    actor that is down (Ray is restarting it)."""
    out = []
    for pending in [a.busy_seconds.remote() for a in actors]:
        try:
            out.append(watchdog.get(pending, "busy_seconds"))
        except ray.exceptions.RayActorError:
            out.append(0.0)
    return out


def await_ready(actors: list, timeout_s: float = 300.0, gone: Callable | None = None, may_lose: int = 0) -> list:
    """Wait until every actor answers `ready` (Ray is restarting the dead ones). An actor Ray will not
    restart (its max_restarts spent) raises at once, not at the timeout. `gone(actor)`: no restart will
    come (its node left); up to `may_lose` such actors are given up on and returned, not waited for."""
    deadline, lost = time.monotonic() + timeout_s, []
    for actor in actors:
        while True:
            left = max(1.0, deadline - time.monotonic())
            try:
                ray.get(actor.ready.remote(), timeout=min(left, GONE_POLL_S) if gone else left)
                break
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                if gone is not None and len(lost) < may_lose and gone(actor):
                    lost.append(actor)
                    break
                if time.monotonic() > deadline or ray_state(actor) == "DEAD":
                    raise
                time.sleep(1.0)
    watchdog.restart_deadline()  # the restart took the phase's time, not the work waited for after it
    return lost


def node_of(actor) -> str:
    """The Ray node id the actor runs on ("" while it has none)."""
    node = actor_table(actor).get("Address", {}).get("NodeID", "")
    return "" if set(node) <= {"0", "f"} else node  # nil ids: no node yet


def alive_nodes() -> set[str]:
    """The ids of the cluster's nodes alive now."""
    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


def actor_table(actor) -> dict:
    """The cluster's actor table entry of the actor (its State, NumRestarts, Pid, Address, ...)."""
    return ray._private.state.actors(actor._actor_id.hex()) or {}


def ray_state(actor) -> str:
    """Ray's state of the actor (ALIVE, RESTARTING, DEAD: gone for good)."""
    return actor_table(actor).get("State", "")


def restart_count(actor) -> int:
    """How often Ray has restarted the actor so far."""
    return int(actor_table(actor).get("NumRestarts", 0))


def died_among(error: BaseException, actors: list) -> bool:
    """Whether `error` (ray.exceptions.RayActorError) reports one of `actors` dead or unreachable."""
    died = getattr(error, "actor_id", None)
    return isinstance(error, ray.exceptions.RayActorError) and died in {a._actor_id.hex() for a in actors}

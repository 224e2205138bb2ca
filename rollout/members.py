"""Members: who the engines of a rollout pool are. An elastic pool (cluster.rollout_workers "min..max") keeps
engines starting where the cluster may make room (Ray places each when a node with the rollout resource joins),
admits them once ready, and drops the engines that died or whose node left; a fixed pool only waits for Ray's
restarts of its engines."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import ray

from runtime import watchdog
from runtime.actors import alive_nodes, await_ready, node_of, ray_state

log = logging.getLogger(__name__)


class EnginesLost(RuntimeError):
    """Fewer engines than cluster.rollout_workers' min remain and none joined in time, or engines crashed on live
    nodes more often than cluster.max_restarts: the run ends resumable, as a fixed pool's does."""


class Members:
    """Owns an elastic pool's membership: the engines still starting (`joining`: Ray places each where a node
    has room, so a node that joins gets them), the node each member runs on, the engines dropped, and the
    counts of engines joined and left. The pool's `workers` stay the members; `start()` starts one more engine
    (a Ray actor). An elastic pool's engines are never restarted by Ray (the pool starts them with max_restarts
    0): a dead one fails its calls at once, where a restart that no node has room for would queue them."""

    def __init__(self, pool, start: Callable[[], object], fewest: int, most: int, max_restarts: int = 0):
        """max_restarts: how many engines may crash (die on a live node) before the run ends, as a fixed pool's
        Ray restarts are bounded (cluster.max_restarts); an engine whose node left does not count."""
        self.pool, self.start, self.max_restarts = pool, start, max_restarts
        self.fewest, self.most = fewest, max(most, fewest)
        self.joined = self.left = self.crashed = 0
        self.departed: set[str] = set()  # the actor ids of engines dropped: a call still pending on one fails later
        self.nodes = {w._actor_id.hex(): node_of(w) for w in pool.workers}
        self.joining: list[tuple[object, ray.ObjectRef]] = []  # (engine, its ready call)
        self._top_up()

    @property
    def elastic(self) -> bool:
        return self.most > self.fewest

    def _top_up(self) -> None:
        """Start engines to wait for room, up to `most` members and joining together."""
        while self.elastic and len(self.pool.workers) + len(self.joining) < self.most:
            engine = self.start()
            self.joining.append((engine, engine.ready.remote()))

    def admit(self) -> int:
        """The joining engines that are ready and alive on a live node, members from now on (last in the pool's
        order); one that died starting, or whose node left since, is replaced. Returns how many joined."""
        if not self.joining:
            return 0
        done = set(ray.wait([ref for _, ref in self.joining], num_returns=len(self.joining), timeout=0)[0])
        waiting, joined, alive = [], 0, alive_nodes()
        for engine, ref in self.joining:
            if ref not in done:
                waiting.append((engine, ref))
            elif self._started(engine, ref, alive):
                self.pool.workers.append(engine)
                self.pool.calls_since_sync.append(0)
                self.nodes[engine._actor_id.hex()] = node_of(engine)
                joined += 1
        self.joining = waiting
        self.joined += joined
        self._top_up()
        return joined

    def _started(self, engine, ref, alive: set[str]) -> bool:
        try:
            ray.get(ref)
            if ray_state(engine) == "ALIVE" and node_of(engine) in alive:
                return True
        except ray.exceptions.RayError as e:
            log.warning("a rollout engine died starting (%s); another waits for room", type(e).__name__)
        ray.kill(engine, no_restart=True)
        return False

    def recover(self, timeout_s: float) -> int:
        """After an engine died: a fixed pool waits until every member answers (Ray restarts the dead). An
        elastic pool drops the members that died or whose node left, then, if fewer than `fewest` remain, waits
        for joining engines up to `timeout_s` (EnginesLost after). Returns how many left."""
        workers = self.pool.workers
        if not self.elastic:
            await_ready(workers, timeout_s)
            return 0
        await_ready(workers, timeout_s, self._gone, len(workers))
        # then every member gone, not only those await_ready gave up on: Ray marks a killed actor DEAD before its
        # process exits, so a call may still be answered by one that is dead already
        left = self._drop(self.gone_members())
        self._refill(timeout_s)
        return left

    def prune(self, timeout_s: float) -> int:
        """Between steps: drop the members that died or whose node left, before a call reaches one (then
        refill to `fewest`, as recover). Returns how many left."""
        if not self.elastic:
            return 0
        left = self._drop(self.gone_members())
        self._refill(timeout_s)
        return left

    def _refill(self, timeout_s: float) -> None:
        deadline, waited = time.monotonic() + timeout_s, False
        while len(self.pool.workers) < self.fewest:
            if self.admit() == 0 and time.monotonic() > deadline:
                raise EnginesLost(
                    f"{len(self.pool.workers)} rollout engine(s) remain, fewer than cluster.rollout_workers' min "
                    f"{self.fewest}, and none joined within {timeout_s:.0f} s"
                )
            waited = True
            time.sleep(1.0)
        if waited:
            watchdog.restart_deadline()  # the wait took the phase's time, not the calls waited for after it

    def _drop(self, gone: list) -> int:
        workers, alive = self.pool.workers, alive_nodes() if gone else set()
        self.crashed += sum(self.nodes.get(engine._actor_id.hex()) in alive for engine in gone)  # on a live node
        if self.crashed > self.max_restarts:
            raise EnginesLost(
                f"rollout engines died on live nodes {self.crashed} times, more than cluster.max_restarts "
                f"({self.max_restarts}) allows"
            )
        for engine in gone:
            i = workers.index(engine)
            del workers[i], self.pool.calls_since_sync[i]
            self.departed.add(engine._actor_id.hex())
            ray.kill(engine, no_restart=True)
        self.left += len(gone)
        self._top_up()
        return len(gone)

    def gone_members(self) -> list:
        """The members dead (no restart comes) or on a node that left (Ray may not have marked them dead yet)."""
        alive = alive_nodes()
        return [w for w in self.pool.workers if self._gone(w, alive)]

    def _gone(self, engine, alive: set[str] | None = None) -> bool:
        node = self.nodes.get(engine._actor_id.hex())
        left = bool(node) and node not in (alive_nodes() if alive is None else alive)
        return left or ray_state(engine) == "DEAD"

    def stop_joining(self) -> list:
        """The engines still starting, no longer waited for (the pool shuts down)."""
        engines, self.joining = [engine for engine, _ in self.joining], []
        return engines

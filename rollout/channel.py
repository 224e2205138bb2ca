"""WeightChannel: the rollout side's end of weight sync. It owns the bucket plan, the wire layout the
engines taught it, the transfer backend (the engines' device and placement decide,
RolloutPool.sync_backend) and the policy version each sync carries. The learner is only the sender
it calls, by these methods: weight_buckets(bucket_mb), sync_address(backend, timeout_s), init_weight_sync(address,
backend) -> pending calls (address: weight_sync.GroupAddress, as rank 0), send_weights(buckets,
background) -> pending calls (on IPC, each rank's update_info).
"""

from __future__ import annotations

from rollout.pool import RolloutPool
from rollout.sync_check import SyncCheck, check
from rollout.weight_sync import IPC_BACKEND, GroupAddress, merge_ipc_update_infos
from runtime import watchdog


class WeightChannel:
    """The rollout side's end of weight sync (see the module docstring): it owns the bucket plan and
    wire layout, the transfer group between the sender and the pool's engines, and the sync still
    in flight."""

    def __init__(
        self,
        pool: RolloutPool,
        sender,
        bucket_mb: int,
        timeout_s: float = 120.0,
        in_flight: bool = False,
        check: SyncCheck | None = None,
    ):
        """in_flight: engines take each sync mid-sequence (async_training.mode in_flight), not between calls.
        check: the sync check after every sync (rollout/sync_check.py); None: none."""
        self.pool, self.sender, self.timeout_s, self.in_flight = pool, sender, timeout_s, in_flight
        self.bucket_bytes = bucket_mb << 20
        self.buckets = sender.weight_buckets(bucket_mb)
        self.wire_planned = False
        self.receiving: list = []  # the engines' receives of a sync still in flight (send(wait=False))
        self.sync_check = check
        self.probe = pool.probe_ids() if check else []
        self.unchecked: tuple | None = None  # a background sync's probe, version and engines, checked once received
        self.probe_gap = float("nan")  # the last sync's (sync/probe_gap)
        self.sent_bytes = float("nan")  # the last sync's payload, as each engine takes it (sync/bytes)
        self.adapter_bytes = sender.adapter_bytes() if pool.adapters else 0  # the same every sync
        self.connect()

    def connect(self, keep_order: bool = False) -> None:
        """(Re)build the transfer group: the sender's rank 0 plus every engine, at a fresh port on
        the sender's node (it serves the group's store; the engines may be on other nodes). After an
        engine restarted, a sync in flight died with the old group. keep_order: engines joined, and the
        calls sent before still run (RolloutPool.init_weight_sync)."""
        self.receiving, self.unchecked = [], None
        if self.pool.adapters:  # no transfer group: an adapter goes through Ray's object store
            if not keep_order:
                self.pool.forget_calls()
            return
        host, port = self.sender.sync_address(self.pool.sync_backend, self.timeout_s)
        engines = self.pool.init_weight_sync(host, port, self.timeout_s, self.bucket_bytes, keep_order)
        address = GroupAddress(host, port, 0, self.pool.sync_world_size, self.timeout_s, self.bucket_bytes)
        watchdog.get(self.sender.init_weight_sync(address, self.pool.sync_backend) + engines)

    def send(self, version: int, wait: bool = True) -> None:
        """Send the sender's weights to every engine as policy `version`. wait=False returns once the
        sender has staged a copy (it broadcasts in the background, and trains meanwhile); each engine
        takes them after the generate calls already running on it, or in flight (mid-sequence) when
        the channel is. The first sync is always waited for: it teaches the wire layout. On IPC the
        engines read the sender's memory: always waited for."""
        self.wait_sent()
        expected = (self.sender.probe_logprobs(self.probe), version) if self.sync_check else None  # before they leave
        if self.pool.adapters:
            return self._send_adapter(version, wait, expected)
        self.sent_bytes = sum(m.numel * m.torch_dtype.itemsize for bucket in self.buckets for m in bucket)
        if self.pool.sync_backend == IPC_BACKEND:
            infos = watchdog.get(self.sender.send_weights(self.buckets), "weight sync (IPC handles)")
            watchdog.get(self.pool.take_update(merge_ipc_update_infos(infos), version, self.in_flight), "weight sync")
            return self._check(expected)
        background = not wait and self.wire_planned
        receiving = self.pool.receive_weights(self.buckets, version, self.in_flight)
        watchdog.get(
            self.sender.send_weights(self.buckets, background) + ([] if background else receiving), "weight sync"
        )
        if background:  # checked on the engines it went to: one that joins meanwhile gets a waited sync of its own
            self.receiving, self.unchecked = receiving, expected and (*expected, list(self.pool.workers))
            return
        if not self.wire_planned:  # the engines have found their layouts: send in them from now on
            self.buckets, self.wire_planned = self.pool.wire_plan(self.buckets), True
        self._check(expected)

    def _send_adapter(self, version: int, wait: bool, expected: tuple | None) -> None:
        """The LoRA adapter alone (learner.lora.sync adapter): rank 0's copy reaches every engine through Ray's
        object store, and each loads it under a new id (rollout/adapters.py)."""
        receiving = self.pool.receive_adapter(self.sender.adapter_weights(), version, self.in_flight)
        self.sent_bytes = self.adapter_bytes
        if not wait:
            self.receiving, self.unchecked = receiving, expected and (*expected, list(self.pool.workers))
            return
        watchdog.get(receiving, "weight sync (LoRA adapter)")
        self._check(expected)

    @property
    def metrics(self) -> dict[str, float]:
        """sync/probe_gap: the last checked sync's (rollout/sync_check.py); sync/bytes: the payload of the last
        sync sent, as each engine takes it (the weights, or the adapter alone); NaN before the first."""
        return {"sync/probe_gap": self.probe_gap, "sync/bytes": self.sent_bytes}

    def wait_sent(self) -> None:
        """Wait for a sync still in flight (a dead engine raises here, as in any other call), then check it."""
        receiving, self.receiving = self.receiving, []
        watchdog.get(receiving, "weight sync (the engines' receive)")
        expected, self.unchecked = self.unchecked, None
        self._check(expected)

    def verify(self, version: int) -> None:
        """The sync check now, with no sync: the engines must hold the sender's current weights (as `version`)."""
        self._check((self.sender.probe_logprobs(self.probe), version))

    def _check(self, expected: tuple | None) -> None:
        """The sync check of the sync whose learner probe is `expected`: (logprobs, version[, the engines it went
        to, of which those still members are probed]), or None (nothing to check)."""
        if expected is not None:
            c, engines = self.sync_check, expected[2] if len(expected) > 2 else None
            got = self.pool.probe(self.probe, engines)
            self.probe_gap = check(expected[0], got, expected[1], c.path, c.tolerance) if got else self.probe_gap

"""The learner's side of weight sync: `WeightSender`, the mixin that gives a `Learner` rank its remote calls
to plan, join and send (relay_gloo, vLLM's NCCL engine, IPC; in the background for asynchronous training),
and `_Sending`, a broadcast on a thread of its own. The receiving side (rollout.weight_sync) defines the
protocol; this module only calls it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

import torch

from learner.models import merged_weights, rollout_weights
from rollout.weight_sync import (
    BACKENDS,
    GLOO_BACKEND,
    IPC_BACKEND,
    GroupAddress,
    NcclSender,
    SyncGroup,
    TensorMeta,
    broadcast_staged,
    decode_plan,
    ipc_update_info,
    plan_buckets,
    send_weights,
    stage_buckets,
    staged_tensors,
    wire_tensors,
)
from runtime.ports import free_port, listening_store


class WeightSender:
    """Mixin of a `Learner` rank: the weights to the rollout engines. Reads the rank's `rank`, `device`,
    `cfg` and `policy`; every rank calls `send_weights` (ZeRO-3 gathers need all of them), rank 0 sends."""

    def _init_sender(self) -> None:
        """The sender's state before init_weight_sync joins a group (in Learner.__init__)."""
        self.sync_group: SyncGroup | NcclSender | None = None  # rank 0: relay_gloo's group, or vLLM's NCCL
        self.sync_backend = GLOO_BACKEND
        self._ipc_kept: list[torch.Tensor] = []  # what the engines' IPC handles point into, until the next sync
        self._sending: _Sending | None = None  # a background weight broadcast (send_weights)
        self._staged: list[torch.Tensor] = []  # its copy of the weights, reused from sync to sync
        self._store = None  # relay_gloo: the group's store, listening since sync_address chose its port

    def weight_buckets(self, bucket_mb: int) -> list[list[TensorMeta]]:
        # sent in the engines' dtype (rollout.dtype = learner.dtype): bf16 autocast runs cast the float32
        # weights on the way, as autocast casts them for the learner's own matmuls; master_weights runs send
        # the bf16 weights the learner computes with, as they are
        metas = [
            TensorMeta(
                n,
                tuple(getattr(p, "ds_shape", p.shape)),
                self.cfg.dtype.value if p.is_floating_point() else str(p.dtype).removeprefix("torch."),
            )
            for n, p in rollout_weights(self.policy)
        ]
        return plan_buckets(metas, bucket_mb << 20)

    def sync_address(self, backend: str = GLOO_BACKEND, timeout_s: float = 300.0) -> tuple[str, int]:
        """Where the weight-sync group's store listens: rank 0 serves it, on its node's IP (the one Ray
        uses between nodes). relay_gloo: the store listens from now on, so the port can't be taken before
        the group forms. vLLM's NCCL engine binds its own store: a port free now."""
        import ray

        ip = ray.util.get_node_ip_address()
        if backend != GLOO_BACKEND:
            return ip, free_port(ip)
        self._store = listening_store(ip, timeout_s)
        return ip, self._store.port

    def init_weight_sync(self, address: GroupAddress, backend: str) -> None:
        """Rank 0 joins the rollout side's group at `address` as its sender (rank 0), on the rollout
        side's `backend` (rollout.weight_sync.BACKENDS)."""
        self._sending = None  # a background sync of the old group died with it (an engine restarted)
        self.sync_backend, self._ipc_kept = backend, []
        if self.rank == 0:
            if BACKENDS.get(backend) != self.device.type:
                raise ValueError(
                    f"weight sync: the rollout engines use {backend}, but learner rank 0 is on "
                    f"{self.device}; give the learner GPUs too (cluster.gpus_per_learner) or neither"
                )
            if backend == GLOO_BACKEND:
                a = address
                store, self._store = self._store, None
                self.sync_group = SyncGroup(a.host, a.port, 0, a.world_size, "gloo", a.timeout_s, store)
            elif backend != IPC_BACKEND:  # vLLM's NCCL engine: its trainer side
                self.sync_group = NcclSender(address.host, address.port, address.world_size, address.bucket_bytes)

    def send_weights(self, plan: bytes, background: bool = False) -> int | dict:
        """Every rank calls this (ZeRO-3 gathers need all of them); rank 0 sends the buckets of
        `plan` (weight_sync.encode_plan). background (asynchronous training, ZeRO 0-2): rank 0
        returns once it has staged a copy, and a thread broadcasts it while the next update runs;
        the next call (or a reconnect) waits for it first. Returns the bytes sent; on IPC, each
        rank's update_info with handles to its own GPU's copy (the channel merges them)."""
        self._await_sent()
        buckets = decode_plan(plan)
        params = merged_weights(self.policy)  # under LoRA: W + BA, computed as each tensor is read
        if self.sync_backend == IPC_BACKEND:  # the engines open the handles later: kept until the next sync
            info, self._ipc_kept = ipc_update_info(self._gathered(buckets, params))
            return info
        if background and self.cfg.zero_stage != 3:
            return self._send_in_background(buckets, params)
        if self.sync_backend != GLOO_BACKEND:
            return self._send_nccl(buckets, params)
        if self.cfg.zero_stage == 3:
            import deepspeed

            sent = 0
            for bucket in buckets:
                with deepspeed.zero.GatheredParameters([params[m.name] for m in bucket]):
                    if self.rank == 0:
                        sent += send_weights(self.sync_group, [bucket], params.__getitem__)
            return sent
        return send_weights(self.sync_group, buckets, params.__getitem__) if self.rank == 0 else 0

    def adapter_weights(self) -> dict:
        """The LoRA adapter as PEFT saves it: its tensors (on the CPU, in the engines' dtype) and its config;
        what each adapter sync loads on the engines (rollout/adapters.py). ZeRO 0-2 only (LoRA refuses 3),
        so rank 0 holds every tensor."""
        import json

        from peft import get_peft_model_state_dict

        lm, dtype = self.policy.lm, getattr(torch, self.cfg.dtype.value)
        # copies: on a float32 CPU rank .to() would hand out the live parameters, which the next update changes
        tensors = {k: v.detach().to("cpu", dtype, copy=True) for k, v in get_peft_model_state_dict(lm).items()}
        config = json.loads(json.dumps(lm.peft_config["default"].to_dict(), default=sorted))  # sets as lists
        return {"tensors": tensors, "config": config}

    def adapter_bytes(self) -> int:
        """The bytes of adapter_weights' tensors (the same every sync: sync/bytes)."""
        item = getattr(torch, self.cfg.dtype.value).itemsize
        return sum(p.numel() * item for n, p in self.policy.lm.named_parameters() if "lora_" in n)

    def _send_in_background(self, buckets: list[list[TensorMeta]], params: Mapping) -> int:
        """Rank 0 stages a copy and a thread sends it (relay_gloo: bucket by bucket; nccl: packed)."""
        if self.rank != 0:
            return 0
        self._staged = stage_buckets(buckets, params.__getitem__, self._staged)
        group, staged = self.sync_group, self._staged
        if self.sync_backend == GLOO_BACKEND:
            self._sending = _Sending(lambda: broadcast_staged(group, staged))
        else:
            self._sending = _Sending(lambda: group.send(staged_tensors(buckets, staged)))
        return sum(t.numel() * t.element_size() for t in self._staged)

    def _send_nccl(self, buckets: list[list[TensorMeta]], params: Mapping) -> int:
        """vLLM's NCCL engine takes one packed stream of every tensor; every rank walks it (ZeRO-3's
        gathers), rank 0 sends."""
        tensors = self._gathered(buckets, params)
        if self.rank == 0:
            return self.sync_group.send(tensors)
        for _ in tensors:
            pass
        return 0

    def _gathered(self, buckets: list[list[TensorMeta]], params: Mapping):
        """wire_tensors of `buckets`; under ZeRO-3 each bucket gathered in turn and copied out (the
        gathered parameters are freed when the next bucket is gathered)."""
        if self.cfg.zero_stage != 3:
            yield from wire_tensors(buckets, params.__getitem__)
            return
        import deepspeed

        for bucket in buckets:
            with deepspeed.zero.GatheredParameters([params[m.name] for m in bucket]):
                yield from ((n, t.clone()) for n, t in wire_tensors([bucket], params.__getitem__))

    def _await_sent(self) -> None:
        sending, self._sending = self._sending, None
        if sending is not None:
            sending.wait()


class _Sending:
    """A weight broadcast on a thread of its own; wait() joins it and raises what it raised."""

    def __init__(self, send: Callable[[], object]):
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(send,), daemon=True, name="relay-weight-sync")
        self.thread.start()

    def _run(self, send: Callable[[], object]) -> None:
        try:
            send()
        except BaseException as e:  # noqa: BLE001 - re-raised by wait(), in the caller's thread
            self.error = e

    def wait(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise RuntimeError(f"the background weight sync failed: {self.error}") from self.error

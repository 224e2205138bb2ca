"""The weight-sync protocol. rollout/ receives, so it defines it; the learner calls `send_weights`.

Engines receive through vLLM's weight-transfer API, on one of three backends (`BACKENDS`): relay's
gloo engine on CPU (rollout/transfer.py), vLLM's NCCL engine on GPU, vLLM's CUDA IPC engine when the
learner shares the engines' GPUs. `init_info` and `update_info` build the payloads each backend's
engine parses; the sender's side of each is here too.

relay_gloo: a `SyncGroup` is a torch.distributed process group of its own (not the default group,
which vLLM uses inside each engine): rank 0 is the sender (learner rank 0), ranks 1..N the rollout
engines. Tensors travel in buckets: each bucket is one flat buffer of one dtype, broadcast once, so a
sync of a model costs a few large collectives instead of one per parameter. The bucket plan (a list
of TensorMeta lists) is fixed by the sender; after the first sync a tensor the engines store
transposed travels transposed (TensorMeta.transposed, RolloutPool.wire_plan).

nccl: vLLM's group (a PyNccl communicator over a StatelessProcessGroup), the sender as vLLM's trainer
side (`NcclSender`); the tensors travel packed in chunks of the bucket size, in Hugging Face layout.
"""

from __future__ import annotations

import contextlib
import datetime
import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

GLOO_BACKEND = "relay_gloo"  # relay's engine (rollout/transfer.py), registered with vLLM's factory
NCCL_BACKEND = "nccl"  # vLLM's NCCLWeightTransferEngine
IPC_BACKEND = "ipc"  # vLLM's IPCWeightTransferEngine: CUDA IPC handles, no group
BACKENDS = {GLOO_BACKEND: "cpu", NCCL_BACKEND: "cuda", IPC_BACKEND: "cuda"}  # the device each moves
NCCL_BUFFERS = 2  # vLLM's packed broadcast: chunks in flight (both ends must agree)


@dataclass(frozen=True)
class TensorMeta:
    """One tensor of a weight bucket on the wire: its Hugging Face name, shape, dtype and layout."""

    name: str  # Hugging Face parameter name, as the engine's load_weights expects
    shape: tuple[int, ...]
    dtype: str  # e.g. "float32"
    # travels as its transpose: the layout the engines store (GPT-2's Conv1D weights), so the
    # sender transposes once instead of every engine on every sync (see RolloutPool.wire_plan)
    transposed: bool = False

    @property
    def wire_shape(self) -> tuple[int, ...]:
        return self.shape[::-1] if self.transposed else self.shape

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def tensor_metas(named_tensors) -> list[TensorMeta]:
    return [TensorMeta(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in named_tensors]


def plan_buckets(metas: list[TensorMeta], bucket_bytes: int) -> list[list[TensorMeta]]:
    """Consecutive tensors of one dtype, up to bucket_bytes each (a bigger tensor travels alone)."""
    buckets: list[list[TensorMeta]] = []
    size = 0
    for m in metas:
        nbytes = m.numel * m.torch_dtype.itemsize
        if buckets and buckets[-1][0].dtype == m.dtype and size + nbytes <= bucket_bytes:
            buckets[-1].append(m)
            size += nbytes
        else:
            buckets.append([m])
            size = nbytes
    return buckets


def encode_plan(buckets: list[list[TensorMeta]]) -> bytes:
    """The bucket plan as bytes, for a Ray call. Ray passes bytes through as they are but pickles
    other objects one by one: a 39-tensor plan as dataclasses added 0.5-1.2 ms to each call
    (measured), against a whole 1M-parameter sync of ~7 ms."""
    return pickle.dumps(buckets)


def decode_plan(plan: bytes) -> list[list[TensorMeta]]:
    return pickle.loads(plan)  # our own driver's bytes, as Ray's own arguments are


class SyncFailed(RuntimeError):
    """A broadcast of the weight-sync group that failed: it timed out (a rank is stuck) or lost a rank
    (one died). Names the group, this rank and the bucket."""


class SyncGroup:
    """A broadcast group of world_size ranks rendezvousing at host:port. Every rank must construct
    it at the same time (the constructor blocks until all have joined). No broadcast waits longer than
    timeout_s: it then raises SyncFailed. Rank 0 may bring the store it already serves at port
    (runtime.ports.listening_store), so no other process can take the port first."""

    def __init__(
        self, host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float = 300.0, store=None
    ):
        self.address, self.timeout_s = f"{host}:{port}", timeout_s
        timeout = datetime.timedelta(seconds=timeout_s)
        if store is None:
            store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
        store.set_timeout(timeout)
        if backend == "gloo":
            self.pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        elif backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        else:
            raise ValueError(f"unknown sync backend {backend!r}; expected gloo or nccl")
        self.rank, self.world_size, self.backend = rank, world_size, backend
        # where this rank's buffers live: NCCL moves device memory (the current GPU), gloo host memory
        self.device = f"cuda:{torch.cuda.current_device()}" if backend == "nccl" else "cpu"
        self._flat: dict[tuple, torch.Tensor] = {}

    def flat(self, slot: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A reusable flat buffer, one per (slot, dtype); two slots serve double buffering.
        A fresh multi-MiB tensor per bucket costs a page fault per 4 KiB on every sync (~0.25 ms per
        MiB on CPU, more than copying the bytes)."""
        key = (slot % 2, dtype)
        buf = self._flat.get(key)
        if buf is None or buf.numel() < numel:
            buf = self._flat[key] = torch.empty(numel, dtype=dtype, device=self.device)
        return buf[:numel]

    def broadcast(self, tensor: torch.Tensor, what: str = "a broadcast") -> None:
        self.wait(self.broadcast_async(tensor), what)

    def wait(self, work, what: str) -> None:
        """Wait for a broadcast's work handle; the backend's error (a timeout, a lost peer) raises SyncFailed."""
        try:
            work.wait()
        except RuntimeError as e:
            timed_out = "timed out" in str(e).lower() or "timeout" in str(e).lower()
            how = f"did not complete within {self.timeout_s:.0f} s (watchdog.collective_timeout_s)"
            raise SyncFailed(
                f"weight sync group at {self.address} ({self.backend}, rank {self.rank} of {self.world_size}): "
                f"{what} {how if timed_out else 'lost a rank of the group'}: {e}"
            ) from e

    def broadcast_async(self, tensor: torch.Tensor):
        """Start a broadcast from rank 0; returns the work handle (call .wait())."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        return self.pg.broadcast([tensor], opts)


def send_weights(group: SyncGroup, buckets: list[list[TensorMeta]], get: Callable[[str], torch.Tensor]) -> int:
    """Broadcast every bucket from rank 0; `get(name)` returns the full (gathered) tensor. Returns bytes sent.

    Double-buffered: bucket k+1 is gathered and flattened while bucket k is on the wire."""
    sent, in_flight = 0, None
    with one_thread(group.device == "cpu"):
        for k, bucket in enumerate(buckets):
            flat = group.flat(k, bucket[0].torch_dtype, sum(m.numel for m in bucket))
            _flatten(bucket, get, flat)
            work = group.broadcast_async(flat)
            if in_flight is not None:
                group.wait(in_flight, f"sending bucket {k} of {len(buckets)}")
            in_flight = work
            sent += flat.numel() * flat.element_size()
        if in_flight is not None:
            group.wait(in_flight, f"sending bucket {len(buckets)} of {len(buckets)}")
    return sent


def stage_buckets(
    buckets: list[list[TensorMeta]], get: Callable[[str], torch.Tensor], out: list[torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """A copy of every bucket in wire layout, into `out`'s tensors where they fit: what a background
    broadcast sends while the weights it copied go on training (asynchronous training)."""
    staged = []
    for k, bucket in enumerate(buckets):
        numel, dtype = sum(m.numel for m in bucket), bucket[0].torch_dtype
        flat = out[k] if out and k < len(out) and out[k].numel() == numel and out[k].dtype == dtype else None
        flat = flat if flat is not None else torch.empty(numel, dtype=dtype, device=get(bucket[0].name).device)
        _flatten(bucket, get, flat)
        staged.append(flat)
    return staged


def broadcast_staged(group: SyncGroup, staged: list[torch.Tensor]) -> None:
    """Broadcast staged buckets in order (receivers use receive_buckets, as for send_weights)."""
    for k, flat in enumerate(staged):
        group.broadcast(flat.to(group.device, non_blocking=True), f"sending staged bucket {k + 1} of {len(staged)}")


def _flatten(bucket: list[TensorMeta], get: Callable[[str], torch.Tensor], flat: torch.Tensor) -> None:
    """Copy the bucket's tensors into `flat` in wire layout (casting and moving as needed)."""
    offset = 0
    for m in bucket:
        t = get(m.name).detach()
        flat[offset : offset + m.numel].view(m.wire_shape).copy_(t.t() if m.transposed else t)
        offset += m.numel


@contextlib.contextmanager
def one_thread(active: bool = True):
    """Run torch's CPU ops on the calling thread alone. Flattening buckets is memory-bound and
    overlaps the wire anyway, while OpenMP's idle workers spin for milliseconds after every parallel
    region, taking the cores the receiving engines need (measured: 7.8 ms of spin per 3 MiB sync
    on 2 cores, more than the broadcast itself)."""
    threads = torch.get_num_threads()
    if active:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def receive_buckets(group: SyncGroup, buckets: list[list[TensorMeta]], reuse: bool = False) -> Iterator[torch.Tensor]:
    """Yield each bucket's flat buffer as it arrives. Double-buffered: while the consumer loads
    bucket k into the engine, bucket k+1 is already being received. reuse: receive into the group's
    two reusable buffers, valid only if the consumer is done with a bucket when it asks for the next
    (a loader that keeps references until later must get fresh tensors)."""
    ready = None  # received and not yet handed out
    for k, bucket in enumerate(buckets):
        numel, dtype = sum(m.numel for m in bucket), bucket[0].torch_dtype
        flat = group.flat(k, dtype, numel) if reuse else torch.empty(numel, dtype=dtype, device=group.device)
        work = group.broadcast_async(flat)
        if ready is not None:
            yield ready
        group.wait(work, f"receiving bucket {k + 1} of {len(buckets)}")
        ready = flat
    if ready is not None:
        yield ready


def receive_weights(
    group: SyncGroup, buckets: list[list[TensorMeta]], reuse: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) as the buckets arrive (see receive_buckets)."""
    for bucket, flat in zip(buckets, receive_buckets(group, buckets, reuse)):
        yield from _split(bucket, flat)


def _split(bucket: list[TensorMeta], flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    offset = 0
    for m in bucket:
        t = flat[offset : offset + m.numel].view(m.wire_shape)
        yield m.name, t.t() if m.transposed else t  # in Hugging Face layout, as loaders expect
        offset += m.numel


# ---- the payloads of vLLM's weight-transfer API, per backend


@dataclass(frozen=True)
class GroupAddress:
    """Where one member joins the sync group: the sender's store, its first rank (the sender 0; an
    engine's TP workers each add their own rank), the group's size, and how it moves the tensors."""

    host: str
    port: int
    rank_offset: int
    world_size: int
    timeout_s: float = 300.0
    bucket_bytes: int = 64 << 20  # nccl: the packed chunk size, the same on both ends


def init_info(backend: str, address: GroupAddress) -> dict:
    """The `init_info` of `init_weight_transfer_engine` for an engine on `backend`."""
    if backend == GLOO_BACKEND:  # rollout.transfer.GlooInitInfo
        return {
            "host": address.host,
            "port": address.port,
            "rank_offset": address.rank_offset,
            "world_size": address.world_size,
            "timeout_s": address.timeout_s,
        }
    if backend == NCCL_BACKEND:  # vLLM's NCCLWeightTransferInitInfo
        return {
            "master_address": address.host,
            "master_port": address.port,
            "rank_offset": address.rank_offset,
            "world_size": address.world_size,
            "packed": True,
            "packed_buffer_size_bytes": address.bucket_bytes,
            "packed_num_buffers": NCCL_BUFFERS,
        }
    if backend == IPC_BACKEND:  # vLLM's IPCWeightTransferInitInfo: no rendezvous
        return {"packed": False}
    raise ValueError(f"unknown weight-transfer backend {backend!r}; expected one of {sorted(BACKENDS)}")


def update_info(backend: str, buckets: list[list[TensorMeta]]) -> dict:
    """The `update_info` of `update_weights` for one full sync of `buckets` over a group (IPC's
    comes from the sender: ipc_update_info)."""
    if backend == GLOO_BACKEND:  # rollout.transfer.GlooUpdateInfo
        return {"plan": encode_plan(buckets)}
    if backend == NCCL_BACKEND:  # vLLM's NCCLWeightTransferUpdateInfo: in Hugging Face layout
        metas = [m for bucket in buckets for m in bucket]
        return {
            "names": [m.name for m in metas],
            "dtype_names": [m.dtype for m in metas],
            "shapes": [list(m.shape) for m in metas],
        }
    raise ValueError(f"weight-transfer backend {backend!r} takes no broadcast plan")


def wire_tensors(buckets: list[list[TensorMeta]], get: Callable[[str], torch.Tensor]):
    """(name, tensor) in the order and wire dtype of `buckets`, Hugging Face layout: what vLLM's
    NCCL and IPC engines receive for update_info(buckets)."""
    for bucket in buckets:
        for m in bucket:
            yield m.name, get(m.name).detach().to(m.torch_dtype)


def staged_tensors(buckets: list[list[TensorMeta]], staged: list[torch.Tensor]):
    """The tensors of stage_buckets' copies, by name (views of them)."""
    for bucket, flat in zip(buckets, staged):
        yield from _split(bucket, flat)


class NcclSender:
    """Rank 0 of vLLM's NCCL weight-transfer group, sending as vLLM's trainer side does
    (nccl_common.trainer_init, packed_tensor.packed_nccl_broadcast_producer): packed chunks of
    bucket_bytes, which the engines' NCCLWeightTransferEngine cuts alike from update_info."""

    device = "cuda"

    def __init__(self, host: str, port: int, world_size: int, bucket_bytes: int):
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        self.address, self.bucket_bytes = f"{host}:{port}", bucket_bytes
        self.comm = trainer_init({"master_address": host, "master_port": port, "world_size": world_size})

    def send(self, tensors) -> int:
        """Broadcast (name, tensor) pairs (wire_tensors); returns the bytes sent."""
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        sent = [0]

        def payload(item: tuple[str, torch.Tensor]) -> torch.Tensor:
            sent[0] += item[1].numel() * item[1].element_size()
            return item[1]

        packed_nccl_broadcast_producer(
            iterator=iter(tensors),
            group=self.comm,
            src=0,
            post_iter_func=payload,
            buffer_size_bytes=self.bucket_bytes,
            num_buffers=NCCL_BUFFERS,
        )
        return sent[0]


def ipc_update_info(tensors) -> tuple[dict, list[torch.Tensor]]:
    """vLLM's IPCWeightTransferUpdateInfo (unpacked) for (name, CUDA tensor) pairs: one handle per
    tensor, keyed by its GPU's UUID; and the tensors the handles point into, which the sender must
    keep alive until the engines have finished the update. Each travels as it is: a cast, a gather or
    LoRA's out-of-place merge made it a copy already, or it is a parameter that stays as it is until
    the engines are done (the next update waits for the sync)."""
    from torch.multiprocessing.reductions import reduce_tensor

    info: dict = {"names": [], "dtype_names": [], "shapes": [], "ipc_handles": []}
    kept = []
    for name, tensor in tensors:
        weight = tensor.detach().contiguous()
        kept.append(weight)
        info["names"].append(name)
        info["dtype_names"].append(str(weight.dtype).removeprefix("torch."))
        info["shapes"].append(list(weight.shape))
        info["ipc_handles"].append({device_id(weight.device): reduce_tensor(weight)[1]})
    return info, kept


def device_id(device: torch.device) -> str:
    """What an IPC handle is keyed by: the GPU's UUID, by which each engine finds the copy on its own
    GPU (a CPU tensor, as tests make: "cpu")."""
    return str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else device.type


def merge_ipc_update_infos(infos: list[dict]) -> dict:
    """One update_info from each learner rank's (each on its own GPU): every tensor's handles for
    every GPU, so each engine finds the copy on its own."""
    merged = dict(infos[0], ipc_handles=[dict(h) for h in infos[0]["ipc_handles"]])
    for info in infos[1:]:
        for handles, more in zip(merged["ipc_handles"], info["ipc_handles"]):
            handles.update(more)
    return merged

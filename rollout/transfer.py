"""relay's gloo weight-transfer engine for vLLM on CPU, registered with vLLM's factory as "relay_gloo".

vLLM drives weight updates through its workers' `init_weight_transfer_engine` / `start_weight_update` /
`update_weights` / `finish_weight_update`, each delegating to the engine that `weight_transfer_config`
names; its own engines (NCCL, CUDA IPC) need a GPU. This one keeps relay's bucket protocol
(rollout/weight_sync.py: a gloo `SyncGroup`, double-buffered receive, the transposed wire layout) and
its verified direct copies into the parameters (rollout/load_routes.py), so a sync costs what it
cost before the move to vLLM's API. The module is imported by rollout/vllm_ext.py, the module
vLLM's workers load as their extension, so every process that builds a model (the Ray actor, vLLM's
engine-core process, each CPU tensor-parallel worker) has the engine registered before it is created.
"""

from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from rollout.load_routes import Copy, Route, bucket_copies, candidate_routes, copy_routed, tied_twins, verified_routes
from rollout.weight_sync import (
    GLOO_BACKEND,
    SyncGroup,
    TensorMeta,
    decode_plan,
    receive_buckets,
    receive_weights,
    tensor_metas,
)

log = logging.getLogger(__name__)


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """How one engine joins the sync group (built by weight_sync.init_info; every TP worker of the
    engine joins, as rank_offset + its rank in the engine)."""

    host: str  # the group's store: the sender's node
    port: int
    rank_offset: int  # this engine's first rank (rollout.pool.sync_ranks)
    world_size: int
    timeout_s: float = 300.0  # no broadcast waits longer: SyncFailed


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One full update: the buckets of `plan` received over the group, or a (name, tensor) list handed
    over in the call itself, pickled (`payload`: the same-node path, Ray's object store on one node;
    vLLM's RPC to the engine's process would turn tensors nested in its arguments into lists)."""

    plan: bytes = b""  # weight_sync.encode_plan(buckets), as the sender's
    payload: bytes = b""
    # copy into the parameters (direct-copy routes, else the model's own load_weights), valid when
    # loading transforms nothing afterwards (CPU with use_plain_cpu_linear, one TP worker); otherwise
    # vLLM's in-place reload, which re-runs that processing. The same on every update of an engine.
    direct: bool = True


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Receives weight buckets over a gloo SyncGroup and copies them into the model's parameters by
    routes found once (rollout/load_routes.py); owns the group, the routes and the last bucket plan.
    Weights apply in place, so start and finish have nothing to do."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: SyncGroup | None = None
        self.routes: dict[str, Route] = {}  # found for the tensor names in
        self.routes_for: frozenset[str] = frozenset()  # this set, found again if the set changes
        self.twins: frozenset[str] = frozenset()
        self.params: dict[str, torch.nn.Parameter] = {}  # the model's, as the routes name them
        self.plan: bytes = b""  # the last bucket plan, decoded:
        self.buckets: list[list[TensorMeta]] = []
        self.copies: list[list[Copy]] | None = None  # its copies, if every tensor has a route
        self.loaded = 0  # tensors of the last update
        self.direct = True  # how it loaded (GlooUpdateInfo.direct)

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        rank = init_info.rank_offset + self.parallel_config.rank  # this worker's rank inside its engine
        self.group = SyncGroup(init_info.host, init_info.port, rank, init_info.world_size, "gloo", init_info.timeout_s)

    def start_weight_update(self) -> None:
        pass  # copies land in place; a reload runs whole inside update_weights

    def finish_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class then synchronizes the accelerator, which a CPU-only torch refuses to do
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        self.direct = update_info.direct
        if update_info.payload:
            named = pickle.loads(update_info.payload)  # our own worker's bytes, as vLLM's RPC arguments are
            if self.direct:
                self._find_routes(tensor_metas(named))
            self._load(iter(named))
            self.loaded = len(named)
            return
        if self.group is None:
            raise RuntimeError("relay_gloo: update_weights before init_weight_transfer_engine")
        if update_info.plan != self.plan:
            self._use_plan(update_info.plan)  # before receiving: finding routes overwrites weights
        if self.copies is not None:
            # Every tensor is copied out by us: buffers reused, vLLM's loader not called at all (its
            # per-call setup delayed the receive by 0.5-1 ms of a 1M sync).
            for copies, flat in zip(self.copies, receive_buckets(self.group, self.buckets, reuse=True)):
                for copy in copies:
                    copy.run(flat)
        else:  # fresh buffers: vLLM's loader may keep references (the reload path does, per layer)
            self._load(receive_weights(self.group, self.buckets))
        self.loaded = sum(len(bucket) for bucket in self.buckets)

    def shutdown(self) -> None:
        self.group = None

    def _load(self, weights) -> None:
        """Load through the routes found beforehand (direct), or vLLM's in-place reload."""
        if not self.direct:
            from vllm.model_executor.model_loader.reload.inplace import reload_weights

            reload_weights(self.vllm_config, self.model, weights, None, True)
            return
        self.model.load_weights(copy_routed(weights, self.routes, self.params, self.twins))

    def _use_plan(self, plan: bytes) -> None:
        """Decode a new bucket plan, find its routes (direct) and, if every tensor has one or is a
        tied twin, the copies that load each bucket; kept until the plan changes."""
        buckets = decode_plan(plan)
        metas = [m for bucket in buckets for m in bucket]
        copies = None
        if self.direct:
            self._find_routes(metas)
            if all(m.name in self.routes or m.name in self.twins for m in metas):
                copies = bucket_copies(buckets, self.routes, self.params, self.twins)
        self.plan, self.buckets, self.copies = plan, buckets, copies

    def _find_routes(self, metas: list[TensorMeta]) -> None:
        """Find the direct-copy routes for this set of tensor names, once (probes overwrite weights:
        only call this right before loading all of them)."""
        names = frozenset(m.name for m in metas)
        if names == self.routes_for:
            return
        params = dict(self.model.named_parameters())
        # packed_modules_mapping: an optional class attribute of vLLM models (absent: nothing fused)
        packed = getattr(self.model, "packed_modules_mapping", {})
        candidates = candidate_routes(metas, {n: tuple(p.shape) for n, p in params.items()}, packed)
        device = str(self.device) if self.device is not None else "cpu"
        self.routes = verified_routes(candidates, metas, params, self.model.load_weights, device)
        self.twins = tied_twins(self.routes, names, self.model)
        self.params = params  # kept: building this dict took 0.3 ms of every 1M sync
        self.routes_for = names
        self.plan = b""  # its copies were made from the old routes
        log.info("weight sync: %d of %d tensors load by direct copy", len(self.routes), len(metas))


def register() -> None:
    """Make "relay_gloo" a backend of vLLM's factory in this process (again: no effect)."""
    try:
        WeightTransferEngineFactory.register_engine(GLOO_BACKEND, GlooWeightTransferEngine)
    except ValueError:  # registered already: by an earlier import of this module under another name
        pass


register()

"""Code that runs inside the vLLM worker: receiving weights, and a CPU fix so new weights are used.

vLLM mixes `WorkerExtension` into its worker class (`worker_extension_cls`); the orchestrator
reaches these methods through `LLM.collective_rpc`. Method names carry a `relay_` prefix because
vLLM refuses extension attributes that collide with its own (e.g. `update_weights`).
"""

from __future__ import annotations

import logging
import os
import pickle

import torch

from rollout.load_routes import Copy, Route, bucket_copies, candidate_routes, copy_routed, tied_twins, verified_routes
from rollout.weight_sync import SyncGroup, TensorMeta, decode_plan, receive_buckets, receive_weights, tensor_metas

log = logging.getLogger(__name__)


class WorkerExtension:
    """Mixed into vLLM's worker: receives weight buckets and copies them into the model's parameters
    (routes found once), holding the sync group and the last bucket plan."""

    _relay_routes: dict[str, Route] = {}  # see rollout/load_routes.py; found for the tensor names in
    _relay_routes_for: frozenset[str] = frozenset()  # this set, found again if the set changes
    _relay_twins: frozenset[str] = frozenset()
    _relay_params: dict[str, torch.nn.Parameter] = {}  # the model's, as the routes name them
    _relay_plan: bytes = b""  # the last bucket plan (weight_sync.encode_plan), decoded
    _relay_buckets: list[list[TensorMeta]] = []
    _relay_copies: list[list[Copy]] | None = None  # its copies, if every tensor has a route

    def relay_init_sync(
        self, host: str, port: int, first_rank: int, world_size: int, backend: str, timeout_s: float
    ) -> None:
        # self.rank: this worker's rank inside its engine (0..TP*PP-1)
        self._relay_group = SyncGroup(host, port, first_rank + self.rank, world_size, backend, timeout_s)

    def relay_receive_weights(self, plan: bytes, direct: bool) -> int:
        """Receive one full broadcast of the buckets in `plan` (weight_sync.encode_plan) and load it;
        returns the number of tensors loaded.

        direct: copy into the parameters, by the routes of rollout/load_routes.py where found and
        through the model's own load_weights otherwise (as vLLM's RLHF examples do); valid when
        loading transforms nothing afterwards (GPU, or CPU with use_plain_cpu_linear). Otherwise
        vLLM's in-place reload, which re-runs that processing."""
        if plan != self._relay_plan:
            self._relay_use_plan(plan, direct)  # before receiving: finding routes overwrites weights
        if self._relay_copies is not None:
            # Every tensor is copied out by us: buffers reused, vLLM's loader not called at all (its
            # per-call setup delayed the receive by 0.5-1 ms of a 1M sync).
            for copies, flat in zip(
                self._relay_copies, receive_buckets(self._relay_group, self._relay_buckets, reuse=True)
            ):
                for copy in copies:
                    copy.run(flat)
        else:  # fresh buffers: vLLM's loader may keep references (the reload path does, per layer)
            self._relay_load(receive_weights(self._relay_group, self._relay_buckets), direct)
        return sum(len(bucket) for bucket in self._relay_buckets)

    def relay_load_weights(self, payload: bytes, direct: bool) -> int:
        """The same-node path: the (name, tensor) list pickled by the worker (RolloutWorker.load_weights)."""
        named_tensors = pickle.loads(payload)  # our own worker's bytes, as vLLM's RPC arguments are
        if direct:
            self._relay_find_routes(tensor_metas(named_tensors))
        self._relay_load(iter(named_tensors), direct)
        return len(named_tensors)

    def relay_routes(self) -> dict[str, tuple[str, int, bool]]:
        """The tensors that load by direct copy: name -> (engine parameter, first row, transposed)."""
        return {name: (r.param, r.row, r.transposed) for name, r in self._relay_routes.items()}

    def _relay_load(self, weights, direct: bool) -> None:
        """Load through the routes found beforehand (direct), or vLLM's reload path."""
        if not direct:
            self.model_runner.reload_weights(weights_iterator=weights)
            return
        model = self.model_runner.get_model()
        model.load_weights(copy_routed(weights, self._relay_routes, self._relay_params, self._relay_twins))

    def _relay_use_plan(self, plan: bytes, direct: bool) -> None:
        """Decode a new bucket plan, find its routes (direct) and, if every tensor has one or is a
        tied twin, the copies that load each bucket; kept until the plan changes."""
        buckets = decode_plan(plan)
        metas = [m for bucket in buckets for m in bucket]
        copies = None
        if direct:
            self._relay_find_routes(metas)
            if all(m.name in self._relay_routes or m.name in self._relay_twins for m in metas):
                copies = bucket_copies(buckets, self._relay_routes, self._relay_params, self._relay_twins)
        self._relay_plan, self._relay_buckets, self._relay_copies = plan, buckets, copies

    def _relay_find_routes(self, metas: list[TensorMeta]) -> None:
        """Find the direct-copy routes for this set of tensor names, once (probes overwrite weights:
        only call this right before loading all of them)."""
        names = frozenset(m.name for m in metas)
        if names == self._relay_routes_for:
            return
        model = self.model_runner.get_model()
        params = dict(model.named_parameters())
        # packed_modules_mapping: an optional class attribute of vLLM models (absent: nothing fused)
        packed = getattr(model, "packed_modules_mapping", {})
        candidates = candidate_routes(metas, {n: tuple(p.shape) for n, p in params.items()}, packed)
        self._relay_routes = verified_routes(candidates, metas, params, model.load_weights, self._relay_device())
        self._relay_twins = tied_twins(self._relay_routes, names, model)
        self._relay_params = params  # kept: building this dict took 0.3 ms of every 1M sync
        self._relay_routes_for = names
        self._relay_plan = b""  # its copies were made from the old routes
        log.info("weight sync: %d of %d tensors load by direct copy", len(self._relay_routes), len(metas))

    def _relay_device(self) -> str:
        return str(self.device) if self.device is not None else "cpu"

    def relay_weight_checksum(self) -> float:
        """Sum of every parameter, to check two engines hold the same weights."""
        return float(sum(p.detach().double().sum() for p in self.model_runner.get_model().parameters()))


def use_plain_cpu_linear() -> None:
    """On CPU, vLLM repacks linear and lm_head weights into oneDNN/SGL handles at load time; on some
    CPUs a later in-place reload then leaves the old packed weights in the matmuls, silently. Keep
    the plain F.linear path so the parameters a reload writes are the ones every matmul reads.
    Must run before the engine loads its model (both call sites import the dispatcher lazily): at the
    import of this module, where rollout.engine.engine_env asked for it."""
    from vllm.model_executor.layers import utils as layer_utils

    def plain(layer: torch.nn.Module, remove_weight: bool) -> None:
        layer.cpu_linear = torch.nn.functional.linear

    layer_utils.dispatch_cpu_unquantized_gemm = plain


# vLLM imports this module in each of an engine's worker processes (worker_extension_cls) before it
# loads the model: the engine core's child process, and every CPU tensor-parallel worker
if os.environ.get("RELAY_CPU_PLAIN_LINEAR") == "1":
    use_plain_cpu_linear()

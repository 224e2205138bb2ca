"""Code that runs inside the vLLM worker: receiving weights, and a CPU fix so new weights are used.

vLLM mixes `WorkerExtension` into its worker class (`worker_extension_cls`); the orchestrator
reaches these methods through `LLM.collective_rpc`. Method names carry a `relay_` prefix because
vLLM refuses extension attributes that collide with its own (e.g. `update_weights`).
"""
from __future__ import annotations

import logging

import torch

from rollout.weight_sync import SyncGroup, TensorMeta, receive_weights

log = logging.getLogger(__name__)


class WorkerExtension:
    def relay_init_sync(self, host: str, port: int, first_rank: int, world_size: int, backend: str, timeout_s: float) -> None:
        # self.rank: this worker's rank inside its engine (0..TP*PP-1)
        self._relay_group = SyncGroup(host, port, first_rank + self.rank, world_size, backend, timeout_s)

    def relay_receive_weights(self, buckets: list[list[TensorMeta]], direct: bool) -> int:
        """Receive one full broadcast and load it; returns the number of tensors loaded.

        direct: copy into the parameters through the model's own load_weights (as vLLM's RLHF
        examples do); valid when loading transforms nothing afterwards (GPU, or CPU with
        use_plain_cpu_linear). Otherwise vLLM's in-place reload, which re-runs that processing."""
        device = str(self.device) if self.device is not None else "cpu"
        count = 0

        def stream():
            nonlocal count
            for name, tensor in receive_weights(self._relay_group, buckets, device):
                count += 1
                yield name, tensor

        self._relay_load(stream(), direct)
        return count

    def relay_load_weights(self, named_tensors: list[tuple[str, torch.Tensor]], direct: bool) -> int:
        """The in-process path: tensors handed over directly (same process, or CUDA IPC rebuilt)."""
        self._relay_load(iter(named_tensors), direct)
        return len(named_tensors)

    def _relay_load(self, weights, direct: bool) -> None:
        if direct:
            self.model_runner.get_model().load_weights(weights)
        else:
            self.model_runner.reload_weights(weights_iterator=weights)

    def relay_weight_checksum(self) -> float:
        """Sum of every parameter, to check two engines hold the same weights."""
        return float(sum(p.detach().double().sum() for p in self.model_runner.get_model().parameters()))


def use_plain_cpu_linear() -> None:
    """On CPU, vLLM repacks linear and lm_head weights into oneDNN/SGL handles at load time; on some
    CPUs a later in-place reload then leaves the old packed weights in the matmuls, silently. Keep
    the plain F.linear path so the parameters a reload writes are the ones every matmul reads.
    Must run before the engine loads its model (both call sites import the dispatcher lazily)."""
    from vllm.model_executor.layers import utils as layer_utils

    def plain(layer: torch.nn.Module, remove_weight: bool) -> None:
        layer.cpu_linear = torch.nn.functional.linear

    layer_utils.dispatch_cpu_unquantized_gemm = plain

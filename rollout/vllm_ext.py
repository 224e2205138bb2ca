"""Code that runs inside the vLLM worker: relay's weight-transfer engine registered, what tests read
of the received weights, and a CPU fix so new weights are used.

vLLM imports this module (`worker_extension_cls`) in every process that builds a model, before the
model and its weight-transfer engine exist: importing rollout.transfer here registers relay's gloo
engine there. Weights themselves arrive through vLLM's own API (`init_weight_transfer_engine`,
`update_weights`, ...); `WorkerExtension` only adds what that API has no call for, reached through
`LLM.collective_rpc`. Its method names carry a `relay_` prefix because vLLM refuses extension
attributes that collide with its own.
"""

from __future__ import annotations

import os

import torch

import rollout.transfer  # noqa: F401 - registers the "relay_gloo" backend in this process


class WorkerExtension:
    """Mixed into vLLM's worker: what tests and the wire plan read of the weights it received."""

    def relay_routes(self) -> dict[str, tuple[str, int, bool]]:
        """The tensors that load by direct copy: name -> (engine parameter, first row, transposed);
        empty for vLLM's own engines, which load through the model's loader."""
        routes = getattr(self.weight_transfer_engine, "routes", {})
        return {name: (r.param, r.row, r.transposed) for name, r in routes.items()}

    def relay_loaded(self) -> int:
        """Tensors of the last weight update (relay's engine; 0 for vLLM's own)."""
        return getattr(self.weight_transfer_engine, "loaded", 0)

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

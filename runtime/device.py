"""The one device decision of a process, and the collective backend that follows from it.

Every role (rollout worker, scoring service, learner rank) calls `process_device()` once and puts
everything it computes on that device: models, inputs, reductions, weight-sync buffers. The
decision comes from the Ray resources the process was given (a GPU when the actor was started
with num_gpus > 0; Ray then makes exactly those GPUs visible), never from what happens to be
installed, so a CPU actor on a GPU node stays on the CPU.
"""

from __future__ import annotations

import os
from contextlib import nullcontext

import torch


def cpu_cores() -> int:
    """The cores this process may run on (its affinity: a `taskset`, a container's cpuset), not the machine's:
    thread counts sized by os.cpu_count() oversubscribe a process pinned to fewer."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def process_device() -> torch.device:
    """cuda:0 (the first GPU Ray assigned to this actor) or cpu. Outside Ray (scripts such as
    scripts/gpu_check.py, tests): $RELAY_DEVICE, default cpu."""
    import os

    try:
        import ray
    except ImportError:  # a machine without Ray (scripts/gpu_check.py on a bare GPU image)
        ray = None
    if ray is None or not ray.is_initialized():
        return torch.device(os.environ.get("RELAY_DEVICE", "cpu"))
    try:
        gpus = ray.get_gpu_ids()
    except Exception:  # the driver of a client connection has no worker context
        return torch.device("cpu")
    return torch.device("cuda", 0) if gpus else torch.device("cpu")


def collective_backend(device: torch.device) -> str:
    """NCCL between GPU processes, gloo between CPU ones: both ends of a group must agree."""
    return "nccl" if device.type == "cuda" else "gloo"


def to_device(tensors, device: torch.device):
    """Every tensor of a tuple/list/dict (or one tensor) on `device`; the one place inputs move,
    so a test can check that nothing skipped the transfer (on the meta device, anything that did fails)."""
    if isinstance(tensors, torch.Tensor):
        return tensors.to(device, non_blocking=True)
    if isinstance(tensors, dict):
        return {k: to_device(v, device) for k, v in tensors.items()}
    if isinstance(tensors, (list, tuple)):
        return type(tensors)(to_device(t, device) for t in tensors)
    return tensors


def compute(dtype: str, device: torch.device, weights: str = "float32"):
    """The context a forward runs in. "bfloat16" over float32 `weights` is mixed precision: matmuls in bf16
    under torch.autocast (CPU cores with AVX512-BF16/AMX and GPUs run them 2-4x faster), softmax and norms as
    autocast keeps them; optimizer, weights and gradients stay float32, and backward, run after the context,
    follows the forward's dtypes (PyTorch's AMP rule). Over bfloat16 `weights` (learner.precision
    master_weights) it computes in the weights' dtype, as the model's code says (no autocast: the bf16 forward
    of verl's and OpenRLHF's learners). The learner, the reference and the SFT/RM stages all use
    it, so their logprobs are the same function."""
    if dtype not in ("float32", "bfloat16"):  # "auto" is resolved at launch (orchestrator/config/dtype.py)
        name = getattr(dtype, "value", dtype)
        raise ValueError(f"learner.dtype {name!r}: expected float32 or bfloat16, resolved before any role starts")
    if dtype == "bfloat16" and weights == "float32":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def bf16_parameters(module: torch.nn.Module) -> torch.nn.Module:
    """Every floating parameter in bf16, the buffers as they are (transformers keeps RoPE's frequencies float32):
    how the learner holds bf16 weights (learner.precision master_weights) and how the reference loads them, so
    the two compute one function; also the few parameters a model keeps float32 under from_pretrained(dtype=bf16)
    (transformers' _keep_in_fp32_modules_strict), as DeepSpeed's bf16 optimizer takes one dtype."""
    for param in module.parameters():
        if param.is_floating_point():
            param.data = param.data.to(torch.bfloat16)
    return module


def malloc_env(keep_freed_memory: bool, gpu: bool, threaded: bool = False) -> dict[str, str]:
    """Environment for a role's process. keep_freed_memory on a CPU process: glibc malloc serves
    every allocation from its heap (no mmap) and never trims it, so the large tensors a step
    allocates again and again (logits, their float32 chunks, gradients) reuse memory instead of
    being mapped, page-faulted and zeroed anew each time: measured on SmolLM2, the scoring
    service spent 1.6-3.9 s of a 3-6 s phase in the kernel, and the learner 4-14 s of an update.
    threaded: an actor with a concurrency group computes in threads of Ray's; one arena serves them
    as it serves the main thread (measured: the scoring service's SmolLM2 phase took 3.5 s, not 1.6 s,
    in a thread's own arena). The cost: a process keeps its peak memory until it exits. GPU
    processes keep glibc's default."""
    if not keep_freed_memory or gpu:
        return {}
    return {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**46)} | (
        {"MALLOC_ARENA_MAX": "1"} if threaded else {}
    )

"""`dtype: auto` for learner.dtype and rollout.dtype, and `precision: auto` for learner.precision, resolved once
at launch, on the driver.

The driver resolves it (load_config) and the roles receive the resolved value with the rest of the config
tree, so the learner, the scoring service and the engines always agree (weights travel in rollout.dtype,
which must equal learner.dtype). The answer comes from the device the learner is placed on: this machine's
CPU, or, with cluster.gpus_per_learner > 0, the GPU this process sees. A cluster whose CPUs differ from
the driver's should name the dtype. `choose` is a pure function of the capabilities; `probe` reads them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from learner.config import LearnerConfig, Precision
from rollout.config import RolloutConfig

# Measured on a 2-core AVX2 EPYC: float32 matmuls 51 GFLOP/s, bf16 0-1 GFLOP/s (PyTorch's scalar fallback)
NO_BF16_KERNELS = "PyTorch falls back to scalar bf16 matmuls here, measured 50-100x slower than float32"
EMULATED = "oneDNN emulates bf16 on it: expect no speed-up over float32"
NATIVE_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")  # /proc/cpuinfo: x86 AMX, x86 AVX512-BF16, arm64 BF16


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What the learner's device can do in bf16."""

    device: str  # "cpu" or "cuda"
    name: str  # what the launch line calls it: "AVX2", "AVX512_BF16", "NVIDIA H100 80GB HBM3"
    native_bf16: bool | None  # bf16 in hardware; None = unknown (a GPU this process cannot see)
    bf16_kernels: bool = True  # bf16 matmul kernels exist (a CPU: oneDNN's, native or emulated on AVX512)


@dataclasses.dataclass(frozen=True)
class Choice:
    """The dtype a key runs in, and what to say about it at launch."""

    dtype: str
    line: str = ""  # printed at launch; "" = nothing to say
    problem: str = ""  # an `auto` that cannot be decided here: the config error's text


def choose(requested: str, caps: Capabilities, keys: str) -> Choice:
    """The dtype `keys` (e.g. "learner.dtype, rollout.dtype") run in, given what they asked for."""
    what = "CPU" if caps.device == "cpu" else "GPU"
    if requested == "auto":
        if caps.native_bf16 is None:
            return Choice(
                "float32",
                problem=(
                    "auto cannot tell whether the learner's GPUs have bf16: this process sees no GPU (cluster."
                    "gpus_per_learner > 0); set learner.dtype and rollout.dtype to bfloat16 or float32"
                ),
            )
        if caps.native_bf16:
            return Choice("bfloat16", f"dtype auto -> bfloat16 ({keys}): this {what} has native bf16 ({caps.name})")
        return Choice("float32", f"dtype auto -> float32 ({keys}): this {what} has no native bf16 ({caps.name})")
    if requested == "bfloat16" and caps.native_bf16 is False:
        slow = NO_BF16_KERNELS if not caps.bf16_kernels else EMULATED if what == "CPU" else "emulated, slower"
        return Choice(
            requested,
            f"warning: {keys} = bfloat16 on a {what} without native bf16 ({caps.name}): {slow}; "
            "dtype auto (or float32) avoids it",
        )
    return Choice(requested)


def probe(device: str) -> Capabilities:
    """This process's capabilities for `device` (cpu or cuda)."""
    import torch

    if device == "cuda":
        if not torch.cuda.is_available():
            return Capabilities("cuda", "", None)
        return Capabilities("cuda", torch.cuda.get_device_name(0), torch.cuda.is_bf16_supported(False))
    native = [f for f in NATIVE_FLAGS if f in cpu_flags()]
    name = native[0].upper() if native else torch.backends.cpu.get_cpu_capability()
    return Capabilities("cpu", name, bool(native), torch.ops.mkldnn._is_mkldnn_bf16_supported())


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The first CPU's feature flags (x86 `flags`, arm64 `Features`); empty where there is no cpuinfo."""
    try:
        lines = Path(cpuinfo).read_text().splitlines()
    except OSError:
        return set()
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def resolve_dtypes(tree, probe=probe) -> tuple[list[str], list[tuple[str, str]]]:
    """Set every `auto` dtype of the tree (a run, a stage or a pipeline) to its choice, in place; returns the
    lines to print and the (key, problem) pairs of the ones that cannot be decided. A rollout.dtype auto
    beside a learner.dtype that names its dtype takes that one (rollout.dtype auto = learner.dtype's choice)."""
    for run in runs_of(tree):
        if run.rollout.dtype == "auto" and _value(run.learner.dtype) != "auto":
            run.rollout.dtype = str(_value(run.learner.dtype))
    groups: dict[tuple[str, str], list[tuple[str, object]]] = {}
    for key, section, device in sorted(_dtype_sections(tree), key=lambda s: s[0]):
        groups.setdefault((device, str(_value(section.dtype))), []).append((key, section))
    lines, problems, caps = [], [], {}
    for (device, requested), members in groups.items():
        if requested not in ("auto", "bfloat16"):
            continue  # nothing to decide or warn about: no probe (it imports torch)
        if device not in caps:
            caps[device] = probe(device)
        choice = choose(requested, caps[device], ", ".join(key for key, _ in members))
        lines += [choice.line] if choice.line else []
        problems += [(key, choice.problem) for key, _ in members if choice.problem]
        for _, section in members:
            section.dtype = type(section.dtype)(choice.dtype)  # LearnerConfig's Dtype, RolloutConfig's str
    return lines + resolve_precision(tree), problems


# Measured with bench/ab.py (docs/benchmarks.md, "bf16 precision"): SmolLM2-135M on an AVX512-BF16 CPU, update
# 0.98x and step 0.96x autocast's time with bf16 weights, which round the checkpoint's float32 weights at load
CPU_AUTOCAST = "on a CPU bf16 weights measured no faster, and autocast keeps the checkpoint's float32 weights"
MASTERS = "bf16 weights and activations, float32 masters and Adam state on the GPU (ZeRO stage 2 at least)"
LORA_AUTOCAST = "LoRA with bf16 weights over float32 masters (DeepSpeed's bf16 optimizer) is not tested yet"


def choose_precision(dtype: str, device: str, lora: bool = False) -> tuple[Precision, str]:
    """learner.precision auto's choice for a learner computing in `dtype` on `device` (with LoRA or not), and why."""
    if dtype != "bfloat16":
        return Precision.autocast, ""  # float32 weights: there is nothing to choose
    if lora:
        return Precision.autocast, LORA_AUTOCAST
    if device == "cuda":
        return Precision.master_weights, MASTERS
    return Precision.autocast, CPU_AUTOCAST


def resolve_precision(tree) -> list[str]:
    """Set every learner.precision auto of the tree (dtypes already resolved) to its choice; the lines to print."""
    lines = []
    for key, section, device in _dtype_sections(tree):
        if isinstance(section, LearnerConfig) and Precision(section.precision) == Precision.auto:
            section.precision, why = choose_precision(str(_value(section.dtype)), device, section.lora.rank > 0)
            where = key.removesuffix(".dtype")
            lines += [f"{where}.precision auto -> {section.precision.value}: {why}"] if why else []
    return lines


def _value(dtype) -> str:
    return getattr(dtype, "value", dtype)


def runs_of(node):
    """Every node of the tree with both a learner and a rollout section (a run, a pipeline's RL stage)."""
    if isinstance(getattr(node, "learner", None), LearnerConfig) and isinstance(
        getattr(node, "rollout", None), RolloutConfig
    ):
        yield node
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value) and hasattr(value, "learner"):
            yield from runs_of(value)


def _dtype_sections(node, prefix: str = ""):
    """(key, section, device) of every learner and rollout section: on cuda when the run places its learner
    on GPUs (cluster.gpus_per_learner); a stage (relay sft/rm) has no cluster and trains on the CPU."""
    cluster = getattr(node, "cluster", None)
    device = "cuda" if cluster is not None and cluster.gpus_per_learner > 0 else "cpu"
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if isinstance(value, (LearnerConfig, RolloutConfig)):
            yield f"{prefix}{f.name}.dtype", value, device
        elif dataclasses.is_dataclass(value) and hasattr(value, "learner"):  # a nested run or stage
            yield from _dtype_sections(value, f"{prefix}{f.name}.")

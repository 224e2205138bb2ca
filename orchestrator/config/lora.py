"""learner.lora.sync: auto, the default, resolved once at launch. GPU engines take the adapter alone: vLLM's punica
kernels apply it, and a sync moves megabytes where the merged model is gigabytes. CPU engines take the merged
weights: on SmolLM2-135M their LoRA kernels generated 2.3x slower than merged weights (12.6 against 5.5 s a
step), far more than the adapter saves in the sync (docs/benchmarks.md, "LoRA sync"). in_flight takes the merged
weights too: a request samples with one adapter from start to end."""

from __future__ import annotations

from learner.lora_config import LoraSync
from orchestrator.config.dtype import runs_of
from orchestrator.config.schema import AsyncMode


def choose_lora_sync(gpu_engines: bool, mode: AsyncMode) -> tuple[LoraSync, str]:
    """learner.lora.sync auto's choice, and why."""
    if mode == AsyncMode.in_flight:
        return LoraSync.merged, "in_flight updates a running request's weights, which one adapter per request cannot"
    if gpu_engines:
        return LoraSync.adapter, "GPU engines serve the adapter with vLLM's LoRA kernels; a sync sends it alone"
    return LoraSync.merged, "CPU engines generated 2.3x slower with vLLM's LoRA kernels than with merged weights"


def resolve_lora_sync(tree) -> list[str]:
    """Every LoRA run's (a pipeline's RL stage too) `auto` sync set, in place; returns the lines to print."""
    lines = []
    for run in runs_of(tree):
        lora = run.learner.lora
        if lora.rank > 0 and LoraSync(lora.sync) == LoraSync.auto:
            lora.sync, why = choose_lora_sync(
                run.cluster.gpus_per_rollout_worker > 0, AsyncMode(run.async_training.mode)
            )
            lines.append(f"learner.lora.sync auto -> {lora.sync.value}: {why}")
    return lines

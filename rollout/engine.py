"""Building a vLLM engine and its sampling parameters from the rollout config section."""

from __future__ import annotations

import logging
import os

import torch

from rollout.adapters import engine_lora_args
from rollout.config import RolloutConfig, SamplingConfig
from rollout.weight_sync import GLOO_BACKEND, IPC_BACKEND, NCCL_BACKEND

log = logging.getLogger(__name__)

PLAIN_LINEAR_ENV = "RELAY_CPU_PLAIN_LINEAR"


def engine_env(cfg: RolloutConfig, threads: int, gpu: bool) -> dict[str, str]:
    """Environment a worker process needs before vLLM is imported."""
    env = {
        # AsyncLLM runs its engine core in a process of its own whatever this says; "0" keeps the model
        # in that process on CPU (vLLM's uni executor) rather than in one more worker process, whose
        # shared-memory queue busy-polls a third of a core while the engine idles (measured): the
        # learner's core in sync mode
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(cfg.kv_cache_space_gb),
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
    }
    if not gpu and cfg.cpu_plain_linear:
        env[PLAIN_LINEAR_ENV] = "1"  # read where vLLM loads the model: rollout.vllm_ext, in the engine's processes
    if threads > 0:
        env["OMP_NUM_THREADS"] = str(threads)
    if cfg.tensor_parallel_size > 1 and not gpu and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind(cfg.tensor_parallel_size)
    return env


def cpu_bind(tp: int) -> str:
    """vLLM's CPU backend binds each TP worker's threads to cores and by default wants a NUMA node per
    worker; on one node, give each worker its own contiguous share of the cores ("0-7|8-15")."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < tp:
        raise ValueError(f"rollout.tensor_parallel_size: {tp} CPU workers need at least {tp} cores, have {len(cores)}")
    share = len(cores) // tp
    parts = [cores[i * share : (i + 1) * share] for i in range(tp)]
    return "|".join(f"{p[0]}-{p[-1]}" if len(p) > 1 else str(p[0]) for p in parts)


def transfer_backend(gpu: bool, colocated: bool) -> str:
    """The weight-transfer backend of an engine (vLLM's `weight_transfer_config`): vLLM's NCCL engine
    on GPU, its CUDA IPC engine when the learner shares the engine's GPUs (colocated: the engines
    sleep while it updates), relay's gloo engine on CPU (rollout/transfer.py)."""
    if not gpu:
        return GLOO_BACKEND
    return IPC_BACKEND if colocated else NCCL_BACKEND


def make_engine(
    cfg: RolloutConfig,
    model_path: str,
    seed: int,
    device: torch.device,
    sleep_mode: bool = False,
    step_samples: int = 0,
    lora_rank: int = 0,
):
    """An AsyncLLM (its engine core in a child process of the worker). `device`: the worker's
    (runtime.device.process_device); sleep mode needs a GPU. `step_samples`: this worker's share of a
    step's samples (RolloutPool), decoded in one wave on CPU. `lora_rank`: serves LoRA adapters (0: none)."""
    # imported late: the environment above must be in place first
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM.from_engine_args(
        AsyncEngineArgs(
            **engine_args(cfg, model_path, seed, device, sleep_mode, step_samples), **engine_lora_args(lora_rank)
        )
    )


def engine_args(
    cfg: RolloutConfig, model_path: str, seed: int, device: torch.device, sleep_mode: bool, step_samples: int
) -> dict:
    """make_engine's vLLM engine arguments (also vllm.LLM's: tests compare the two engines)."""
    from vllm.config import WeightTransferConfig

    if cfg.dtype == "auto":  # vLLM's own "auto" would mean the checkpoint's dtype, not the learner's
        raise ValueError("rollout.dtype auto: resolved at launch (orchestrator/config/dtype.py), never by vLLM")
    gpu = device.type == "cuda"
    if gpu:
        extra = {"gpu_memory_utilization": cfg.gpu_memory_utilization, "enable_sleep_mode": sleep_mode}
    else:
        # A prompt split over two scheduler steps (chunked prefill) has its first sampled token
        # discarded, and vLLM then rewinds the request's seeded generator, which a CPU generator
        # cannot do ("CPU Generator does not use offset"). Whole prompts per step avoid it.
        extra = {"enable_chunked_prefill": False}
    return dict(
        model=model_path,
        dtype=cfg.dtype,
        enforce_eager=cfg.enforce_eager,
        max_model_len=cfg.max_model_len,
        tensor_parallel_size=cfg.tensor_parallel_size,
        seed=seed,
        worker_extension_cls="rollout.vllm_ext.WorkerExtension",  # importing it registers relay_gloo
        # sleep mode: the learner shares the engine's GPUs (RolloutPool: colocated)
        weight_transfer_config=WeightTransferConfig(backend=transfer_backend(gpu, sleep_mode)),
        # logprobs of the distribution actually sampled from (after temperature), not the raw one
        logprobs_mode="processed_logprobs",
        **engine_batch(cfg, gpu, step_samples),
        enable_prefix_caching=cfg.enable_prefix_caching,
        disable_log_stats=True,  # relay reports its own throughput
        **extra,
    )


def engine_batch(cfg: RolloutConfig, gpu: bool, step_samples: int) -> dict:
    """vLLM's max_num_seqs: rollout.max_num_seqs if set; else on CPU the step's samples in one wave
    (a second wave repeats every decode step's fixed cost, which dominates small models on CPU); on
    GPU vLLM's own default, sized for its memory."""
    if cfg.max_num_seqs:
        return {"max_num_seqs": cfg.max_num_seqs}
    return {} if gpu else {"max_num_seqs": max(256, step_samples)}


def sampling_params(s: SamplingConfig, seed: int, greedy: bool = False, max_tokens: int | None = None):
    """max_tokens: this request's cap when below s.max_new_tokens (an episode's token budget)."""
    from vllm import SamplingParams

    return SamplingParams(
        n=1 if greedy else s.n_samples_per_prompt,
        temperature=0.0 if greedy else s.temperature,
        top_k=s.top_k,
        top_p=s.top_p,
        repetition_penalty=s.repetition_penalty,
        max_tokens=s.max_new_tokens if max_tokens is None else max_tokens,
        stop=list(s.stop) or None,
        stop_token_ids=list(s.stop_token_ids) or None,
        seed=None if greedy else seed,
        logprobs=0,  # the sampled token's own logprob
        # vLLM detokenizes every sequence token by token in Python, a large share of a small model's
        # step on CPU; only stop strings need that. Without them, RolloutWorker decodes in one batch.
        detokenize=bool(s.stop),
    )


def sampled_logprobs(completion) -> list[float]:
    """The logprob of each token a vLLM completion sampled (requested with logprobs=0)."""
    return [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]


def completion_text(completion, tokenizer, params) -> str:
    """A completion's text: vLLM's where it detokenized (`params`, a call with stop strings), else decoded
    here. vLLM's text may be empty where its tokens are not: a sample that met a stop string at once."""
    if params.detokenize:
        return completion.text
    return tokenizer.decode(completion.token_ids, skip_special_tokens=True)

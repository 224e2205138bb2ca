"""`relay plan`'s per-role arithmetic: the lines (what, bytes, how it was counted) of one learner rank, one
rollout worker and the scoring service, from the models' shapes (plan_model.py)."""

from __future__ import annotations

from dataclasses import dataclass

from learner.precision import bucket_elements, master_weights, zero_stage
from orchestrator.tools.plan_model import (
    DTYPE_BYTES,
    ModelShape,
    activation_bytes,
    fmt,
    fmt_params,
    kv_bytes_per_token,
    layer_params,
    logits_bytes,
    lora_params,
    param_count,
    training_states,
    vllm_gpu,
)
from runtime.forward import PolicyFunction

# ---------------------------------------------------------------- roles
Lines = list[tuple[str, float, str]]  # (what, bytes, how it was counted)
RESIDENT = ("weights", "gradients", "optimizer", "bucket")  # what a learner keeps between updates (by last word)
# runtime/packing.py: rows no longer than the longest sequence (packing_row_tokens 0) hold at most the padded rows'
# tokens, so the worst case (every sequence at the full length) is the padded one; mixed lengths compute fewer
PACKED = "; packed (learner.packing): the same at full length, about the real tokens' share for mixed lengths"


@dataclass
class RankLoad:
    """What each learner rank trains on: `ranks` of them share the states (ZeRO), each runs micro-batches of
    `micro_batch` sequences of `tokens` tokens."""

    ranks: int
    micro_batch: int
    tokens: int


def learner_lines(
    s: ModelShape,
    lc,
    load: RankLoad,
    who: str = "policy",
    lm_head: bool = True,
    scalar_head: bool = False,
    entropy_grad: bool = False,
) -> Lines:
    """One trained model on one learner rank: states, activations and (with an LM head) logits."""
    ranks, micro_batch, tokens = load.ranks, load.micro_batch, load.tokens
    n, master, stage = (
        param_count(s, lm_head) + (s.hidden + 1 if scalar_head else 0),
        master_weights(lc),
        zero_stage(lc),
    )
    precision = ", bf16 weights with float32 masters" if master else ""
    trainable, how = n, f"ZeRO-{stage} over {ranks} rank(s), {lc.dtype.value}{precision}"
    if lc.lora.rank:  # the base stays frozen: gradients and AdamW state for the adapters (and heads) only
        adapters = lora_params(s, lc.lora.rank, list(lc.lora.target_modules))
        trainable, n = adapters + n - param_count(s, lm_head), n + adapters
        how += f", LoRA rank {lc.lora.rank}: {fmt_params(adapters)} of {fmt_params(n)} params trained"
    lines = [
        (f"{who} {k}", v, how) for k, v in training_states(n, trainable, lc.dtype.value, stage, ranks, master).items()
    ]
    if stage >= 2:  # DeepSpeed's gradient bucket (learner.engine.deepspeed_config)
        lines += reduce_bucket_lines(trainable, master, stage, who)
    if stage == 3:  # each layer's weights are gathered whole to compute it
        weight = DTYPE_BYTES["bfloat16" if master else "float32"]
        lines.append((f"{who} gathered layer", layer_params(s) * weight, "ZeRO-3: one layer's full weights"))
    ckpt = lc.gradient_checkpointing
    other = activation_bytes(s, micro_batch, tokens, lc.dtype.value, not ckpt)
    lines.append(
        (
            f"{who} activations",
            activation_bytes(s, micro_batch, tokens, lc.dtype.value, ckpt),
            f"micro-batch {micro_batch} x {tokens} tokens, gradient checkpointing {'on' if ckpt else 'off'} "
            f"({'off' if ckpt else 'on'}: {fmt(other)})" + (PACKED if getattr(lc, "packing", False) else ""),
        )
    )
    attention = attention_line(s, lc, micro_batch, tokens, who)
    lines += [attention] if attention else []
    if lm_head:  # the loss's logprobs (and entropy) come chunk by chunk: runtime/logprobs.py
        temps = "backward with entropy" if entropy_grad else "backward"
        lines.append(
            (f"{who} logits", *logits_bytes(s, micro_batch, tokens, lc.dtype.value, lc.logprob_chunk_tokens, temps))
        )
    return lines


def reduce_bucket_lines(trainable: int, master: bool, stage: int, who: str) -> Lines:
    """ZeRO 2-3's gradient bucket of bucket_elements(trained parameters), kept allocated, in DeepSpeed 0.19's
    dtypes: float32 under autocast; under master weights bf16 at ZeRO 2, with a bf16 flat copy and its float32
    copy while it is reduced (communication_data_type), and float32 at ZeRO 3, which fills it directly."""
    elements = bucket_elements(trainable)
    how = f"ZeRO {stage}: {elements:,} gradient elements"
    if not master or stage == 3:
        return [(f"{who} reduce bucket", elements * 4, how + ", float32")]
    copy = (f"{who} reduce copy", elements * 6, "bf16 flat and float32 copies while the bucket is reduced, then freed")
    return [(f"{who} reduce bucket", elements * 2, how + ", bf16"), copy]


def attention_line(s: ModelShape, lc, micro_batch: int, tokens: int, who: str):
    """What attention keeps beyond activation_bytes (which assumes SDPA on rows of `tokens`): eager's scores and
    probabilities, each layer's [heads, W, W] per row kept for backward, or the boolean mask of packed rows
    wider than a sequence (packing_row_tokens). W: a row's width; rows x W = micro_batch x tokens at most."""
    kernel = str(getattr(lc.attn_implementation, "value", lc.attn_implementation))
    width = max(lc.packing_row_tokens, tokens) if lc.packing and kernel != "flash_attention_2" else tokens
    if kernel == "eager":
        scores = 2 * s.layers * s.heads * micro_batch * tokens * width * DTYPE_BYTES[lc.dtype.value]
        return (
            f"{who} attention scores",
            scores,
            f"eager: scores and probabilities, {s.heads} heads x rows {width} wide",
        )
    if width > tokens:
        return (
            f"{who} attention mask",
            micro_batch * tokens * width,
            f"packed rows {width} tokens wide, bool [W, W] each",
        )
    return None


def scoring_lines(
    ref: ModelShape | None, rms: list[ModelShape], micro_batch: int, tokens: int, function: PolicyFunction
) -> Lines:
    """The frozen scoring service in the learner's dtype: reference policy (the policy's weight dtype, computed in
    its dtype: runtime.device.compute), reward models, and the reference's logits (its peak: the layers' smaller
    temporaries are freed by then). ref None: the learner computes the reference (LoRA's base), none loaded here."""
    dtype, weights, chunk_tokens = function.dtype, function.weights, function.chunk_tokens
    b = DTYPE_BYTES[dtype]
    lines = (
        [
            ("reference weights", param_count(ref) * DTYPE_BYTES[weights], f"{weights}, computed in {dtype}"),
            ("reference logits", *logits_bytes(ref, micro_batch, tokens, dtype, chunk_tokens, "no grad")),
        ]
        if ref is not None
        else [("reference weights", 0, "none: the learner's base, its LoRA adapter off (learner.lora.reference)")]
    )
    lines += [
        (f"reward model {i} weights", (param_count(s, lm_head=False) + s.hidden + 1) * b, dtype)
        for i, s in enumerate(rms)
    ]
    return lines


def rollout_lines(s: ModelShape, rc, gpu_bytes: float | None) -> Lines:
    """One vLLM worker, per device: weights split by tensor parallelism, the rest KV cache."""
    tp, per_token = rc.tensor_parallel_size, kv_bytes_per_token(s, rc.dtype, rc.tensor_parallel_size)
    if gpu_bytes is None:  # CPU: the KV cache is a fixed size (VLLM_CPU_KVCACHE_SPACE)
        weights, kv, how = (
            param_count(s) * DTYPE_BYTES[rc.dtype] / tp,
            rc.kv_cache_space_gb * 2**30,
            "rollout.kv_cache_space_gb",
        )
    else:
        v = vllm_gpu(s, rc.dtype, tp, rc.gpu_memory_utilization, gpu_bytes)
        weights, kv, how = v["weights"], v["kv_cache"], f"{rc.gpu_memory_utilization} x GPU - weights"
    return [
        ("vLLM weights", weights, f"{rc.dtype}, tensor parallel {tp}"),
        (
            "vLLM KV cache",
            kv,
            f"{how}: {kv / per_token:,.0f} tokens at {per_token:,.0f} B/token (max_model_len {rc.max_model_len})",
        ),
    ]


def lora_engine_lines(s: ModelShape, lc, dtype: str, tp: int) -> Lines:
    """An engine serving adapters (learner.lora.sync adapter, rollout/adapters.py): vLLM's LoRA slots, allocated
    for LORA_SLOTS adapters of the slot rank on every linear layer its LoRA wraps (split by tensor parallelism),
    and the adapters it holds: the newest, and the one before while a request still samples with it."""
    from rollout.adapters import LORA_SLOTS, slot_rank

    b, slot, targets = DTYPE_BYTES[dtype], slot_rank(lc.lora.rank), list(lc.lora.target_modules)
    adapter = lora_params(s, lc.lora.rank, targets) * b
    return [
        (
            "vLLM LoRA slots",
            LORA_SLOTS * lora_params(s, slot, LLAMA_LINEAR) * b / tp,
            f"{LORA_SLOTS} adapters, rank {slot}",
        ),
        (
            "vLLM LoRA adapters",
            LORA_SLOTS * adapter,
            f"host memory; each sync sends one, {fmt(adapter)}, not the model",
        ),
    ]


LLAMA_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # what vLLM's LoRA wraps


def total(lines: Lines, only: tuple[str, ...] = ()) -> float:
    return sum(b for what, b, _ in lines if not only or what.split()[-1] in only)

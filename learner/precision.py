"""How the learner computes, from its config section: the policy's forward (for the reference to compute the same
function), whether it holds bf16 weights over float32 masters, and the ZeRO stage it runs. No torch here: the
driver's config checks and `relay plan` read them too."""

from __future__ import annotations

from learner.config import Attention, Dtype, LearnerConfig, Precision
from runtime.forward import PolicyFunction


def policy_function(cfg: LearnerConfig) -> PolicyFunction:
    """How the learner computes the policy's forward, for the reference to compute it the same way."""
    return PolicyFunction(
        Dtype(cfg.dtype).value,
        cfg.logprob_chunk_tokens,
        cfg.packing_row_tokens if cfg.packing else None,
        Attention(cfg.attn_implementation).value,
        "bfloat16" if master_weights(cfg) else "float32",
    )


def master_weights(cfg: LearnerConfig) -> bool:
    """Whether the learner holds bf16 weights with float32 masters (learner.precision master_weights, resolved
    at launch; a learner outside a run leaves auto: autocast, as before the key existed)."""
    return Precision(cfg.precision) == Precision.master_weights and Dtype(cfg.dtype) == Dtype.bfloat16


BUCKET = int(5e8)  # DeepSpeed's default reduce and all-gather bucket (elements), allocated whatever the model's size


def bucket_elements(trained: int) -> int:
    """ZeRO's reduce and all-gather buckets for `trained` parameters: DeepSpeed's 5e8 elements, or fewer for a
    smaller model, rounded up to a multiple of its alignment (2 to 8 elements)."""
    return min(BUCKET, -(-max(trained, 1) // 8) * 8)


def zero_stage(cfg: LearnerConfig) -> int:
    """The ZeRO stage the learner runs: learner.zero_stage, at least 2 under master weights. There DeepSpeed 0.19
    sums a step's micro-batch gradients in float32 (data_types.grad_accum_dtype fp32); its stage-0 and stage-1
    bf16 optimizers sum them in bf16 whatever that key says (tests/unit/learner/test_master_weights.py measured
    a 1.5e-3 gradient error on a toy model). Stage 2 only shards gradients, masters and Adam state, which one
    rank keeps whole; OpenRLHF's default stage."""
    return max(cfg.zero_stage, 2) if master_weights(cfg) else cfg.zero_stage

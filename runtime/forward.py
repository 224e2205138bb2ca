"""How the policy's forward is computed: the settings the learner and the reference model share (no torch here:
the config tree imports it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PolicyFunction:
    """How the policy's forward is computed, as the learner computes it: the reference model computes its
    logprobs the same way, so at step 0 they are the policy's (learner.dtype, logprob_chunk_tokens, packing,
    attn_implementation, precision: `learner.precision.policy_function`)."""

    dtype: str = "float32"
    """float32 or bfloat16 (runtime.device.compute)"""
    chunk_tokens: int = 1024  # runtime.logprobs.DEFAULT_CHUNK_TOKENS (not imported here: that module imports torch)
    """tokens whose logits are upcast to float32 at once"""
    packing: int | None = None
    """a packed row's token budget (runtime/packing.py; 0 = the longest sequence); None = padded rows"""
    attention: str = "sdpa"
    """transformers' attn_implementation"""
    weights: str = "float32"
    """the weights' dtype: float32 (bfloat16 computes under autocast), or bfloat16 (learner.precision
    master_weights: the forward computes in the weights' dtype)"""

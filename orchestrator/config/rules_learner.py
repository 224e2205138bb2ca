"""Rules for the learner section: ZeRO, the optimizer, LoRA and the critic."""

from __future__ import annotations

import importlib.util

from learner.config import Attention, CriticInit, Precision, ValueHead


def check_learner(cfg):
    lr = cfg.learner
    if lr.zero_stage not in (0, 1, 2, 3):
        yield "learner.zero_stage", f"must be 0, 1, 2 or 3, got {lr.zero_stage}"
    if lr.lr <= 0:
        yield "learner.lr", f"must be > 0, got {lr.lr}"
    if len(lr.betas) != 2 or not all(0 <= b < 1 for b in lr.betas):
        yield "learner.betas", f"must be two numbers in [0, 1), got {list(lr.betas)}"
    if lr.lora.rank < 0:
        yield "learner.lora.rank", f"must be >= 0, got {lr.lora.rank}"
    if lr.lora.rank > 0 and lr.lora.dropout != 0:
        yield (
            "learner.lora.dropout",
            (
                f"must be 0 for RL, got {lr.lora.dropout}: dropout makes the update's forward "
                "another function than the one that computed the old logprobs (and than the "
                "reference), so the PPO ratio and the KL start away from 1 and 0"
            ),
        )
    if lr.lora.rank > 0 and lr.zero_stage == 3:
        yield (
            "learner.lora.rank",
            "LoRA under ZeRO-3 is not supported (rank 0 reads the adapter and the merged weights whole); "
            "use zero_stage <= 2",
        )
    yield from check_attention(cfg)
    yield from check_precision(lr)
    needs_critic = cfg.algorithm.needs_critic
    if (
        needs_critic
        and lr.value_head == ValueHead.separate
        and lr.critic_init == CriticInit.reward_model
        and not lr.critic_model_path
    ):
        yield "learner.critic_model_path", "critic_init is reward_model: give the reward model's folder"
    if needs_critic and lr.value_head == ValueHead.shared and lr.lora.rank > 0:
        yield "learner.value_head", "a shared value head with LoRA trains the head on a frozen trunk; use separate"


def check_attention(cfg, installed=lambda name: importlib.util.find_spec(name) is not None):
    """flash_attention_2 needs the flash-attn package and a GPU learner; sdpa and eager run anywhere (a model
    whose class has no sdpa kernel fails as it loads, with transformers' own message under this key)."""
    lr = cfg.learner
    if lr.packing_row_tokens < 0:
        yield "learner.packing_row_tokens", f"must be >= 0 (0 = the longest sequence), got {lr.packing_row_tokens}"
    if Attention(lr.attn_implementation) != Attention.flash_attention_2:
        return
    if not installed("flash_attn"):
        yield "learner.attn_implementation", "flash_attention_2 needs the flash-attn package (pip install flash-attn)"
    for key in ("gpus_per_learner", "gpus_per_scoring"):  # the reference computes the policy's function: same kernel
        if getattr(cfg.cluster, key) <= 0:
            yield "learner.attn_implementation", f"flash_attention_2 runs on GPUs only: cluster.{key} is 0"
    if str(getattr(lr.dtype, "value", lr.dtype)) == "float32":
        yield "learner.attn_implementation", "flash_attention_2 computes in bf16 or fp16: set learner.dtype=bfloat16"


def check_precision(lr):
    """master_weights holds bf16 weights: a float32 run has none, and with LoRA it is not tested yet."""
    if Precision(lr.precision) != Precision.master_weights:
        return
    if str(getattr(lr.dtype, "value", lr.dtype)) != "bfloat16":
        yield "learner.precision", "master_weights holds bf16 weights: set learner.dtype=bfloat16 (or precision=auto)"
    if lr.lora.rank > 0:
        yield (
            "learner.precision",
            "master_weights with LoRA (DeepSpeed's bf16 optimizer over frozen bf16 base weights) is not tested yet; "
            "use precision=autocast with LoRA",
        )


def critic_path_used(cfg) -> bool:
    """learner.critic_model_path is read only to start a separate critic from a reward model
    (learner.models.build_critic), in a run that has a critic at all: elsewhere it is ignored."""
    lr = cfg.learner
    return (
        hasattr(cfg, "algorithm")
        and cfg.algorithm.needs_critic
        and lr.value_head == ValueHead.separate
        and lr.critic_init == CriticInit.reward_model
    )

"""Rules for the learner section: ZeRO, the optimizer, LoRA and the critic."""

from __future__ import annotations

from learner.config import CriticInit, ValueHead


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
            "LoRA under ZeRO-3 is not supported (merging needs gathered weights); use zero_stage <= 2",
        )
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

"""Checks across the whole tree that types alone cannot express. Each yields (key, problem)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from orchestrator.config.rules_algorithm import check_algorithm, check_batches, check_method
from orchestrator.config.rules_learner import check_learner, check_precision, critic_path_used
from orchestrator.config.rules_reward import check_rewards
from orchestrator.config.rules_rollout import check_env, check_sampling
from orchestrator.config.rules_run import (
    check_checkpoint,
    check_cluster,
    check_data,
    check_eval,
    check_health,
    check_watchdog,
)
from reward_service.config import SourceKind


def validate(cfg) -> Iterator[tuple[str, str]]:
    yield from check_sampling(cfg)
    yield from check_method(cfg)
    yield from check_algorithm(cfg)
    yield from check_batches(cfg)
    yield from check_learner(cfg)
    yield from check_rewards(cfg.reward)
    yield from check_cluster(cfg)
    yield from check_data(cfg.data)
    yield from check_env(cfg)
    yield from check_watchdog(cfg.watchdog)
    yield from check_checkpoint(cfg.checkpoint)
    yield from check_eval(cfg)
    yield from check_health(cfg.health)


def validate_stage(cfg, prefix: str = "") -> Iterator[tuple[str, str]]:
    """relay sft / relay rm."""
    t = cfg.train
    yield from check_data(cfg.data, prefix)
    if t.batch_size % (t.micro_batch_size * cfg.learner_ranks):
        yield (
            f"{prefix}train.batch_size",
            f"must be a multiple of train.micro_batch_size x learner_ranks "
            f"({t.micro_batch_size} x {cfg.learner_ranks}), got {t.batch_size}",
        )
    for key in ("steps", "batch_size", "micro_batch_size", "max_length", "eval_every"):
        if getattr(t, key) < 1:
            yield f"{prefix}train.{key}", f"must be >= 1, got {getattr(t, key)}"
    if cfg.data.rejected_from.value == "samples" and not cfg.data.task:
        yield f"{prefix}data.rejected_from", "samples needs data.task (its answers grade the samples)"
    if cfg.data.rejected_from.value == "samples" and cfg.data.apply_chat_template:
        yield f"{prefix}data.rejected_from", "samples samples text prompts only, not data.apply_chat_template"
    if cfg.data.rejected_samples < 1:
        yield f"{prefix}data.rejected_samples", f"must be >= 1, got {cfg.data.rejected_samples}"
    if cfg.scratch.tokenizer not in ("char", "bpe"):
        yield f"{prefix}scratch.tokenizer", f"must be char or bpe, got {cfg.scratch.tokenizer!r}"
    yield from ((f"{prefix}{key}", problem) for key, problem in check_precision(cfg.learner))


def validate_pipeline(cfg) -> Iterator[tuple[str, str]]:
    """The stages; the PPO section is checked once the earlier stages have given it its paths."""
    yield from validate_stage(cfg.sft, "sft.")
    yield from validate_stage(cfg.rm, "rm.")


def validate_reward(reward) -> Iterator[tuple[str, str]]:
    """For commands that use the reward section alone (relay serve-reward)."""
    yield from check_rewards(reward)


def validate_model_paths(cfg, prefix: str = "") -> Iterator[tuple[str, str]]:
    """The model folders a train, sft, rm or pipeline config names exist here (a builtin:// name is
    built on first use; "" is filled in or built): checked by the commands that start work, before
    Ray, rather than by every load (a cluster's config is read and shown on a laptop too)."""
    if hasattr(cfg, "sft"):  # PipelineConfig: each stage
        for stage in ("sft", "rm", "ppo"):
            yield from validate_model_paths(getattr(cfg, stage), f"{stage}.")
        return
    paths = [("learner.model_path", cfg.learner.model_path)]
    if critic_path_used(cfg):
        paths.append(("learner.critic_model_path", cfg.learner.critic_model_path))
    if hasattr(cfg, "reward"):  # TrainConfig
        paths.append(("reward.reference_model_path", cfg.reward.reference_model_path))
        paths += [
            (f"reward.sources.{i}.model_path", s.model_path)
            for i, s in enumerate(cfg.reward.sources)
            if s.kind == SourceKind.reward_model
        ]
    for key, path in paths:
        if path and not path.startswith("builtin://") and not Path(path).is_dir():
            yield (
                prefix + key,
                (
                    f"{path!r}: no such folder here; give a local Hugging Face model folder"
                    f"{' or builtin://NAME' if key == 'learner.model_path' else ''}"
                ),
            )

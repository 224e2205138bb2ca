"""Rules for the sections the run itself owns (schema.py): cluster and async training, data,
evaluation, health and the watchdog."""

from __future__ import annotations

import dataclasses

from orchestrator.config.rules_reward import check_rewards
from orchestrator.config.schema import engine_range, eval_samples


def check_cluster(cfg):
    c = cfg.cluster
    if c.gpus_per_rollout_worker > 0 and c.gpus_per_learner == 0:
        yield (
            "cluster.gpus_per_learner",
            (
                "the rollout engines are on GPUs, so weights travel by NCCL, which the "
                "learner can only join from a GPU: give it GPUs too"
            ),
        )
    if cfg.rollout.dtype != cfg.learner.dtype.value:
        yield (
            "rollout.dtype",
            (
                f"{cfg.rollout.dtype} differs from learner.dtype ({cfg.learner.dtype.value}): the "
                "behaviour logprobs would drift from the learner's; sample in the learner's dtype"
            ),
        )
    a = cfg.async_training
    if a.max_staleness < 1:
        yield "async_training.max_staleness", f"must be >= 1 (mode sync trains on fresh samples), got {a.max_staleness}"
    if a.mode.value != "sync" and c.colocate and c.gpus_per_rollout_worker > 0 and c.gpus_per_learner > 0:
        yield (
            "async_training.mode",
            (
                "engines colocated with the learner on GPUs sleep while it trains, so nothing can "
                "overlap: use mode sync, or cluster.colocate false"
            ),
        )
    if c.learner_ranks < 1:
        yield "cluster.learner_ranks", f"must be >= 1, got {c.learner_ranks}"
    lora = cfg.learner.lora
    if lora.rank > 0 and lora.sync.value == "adapter" and a.mode.value == "in_flight":
        yield (
            "learner.lora.sync",
            (
                "in_flight updates a running sequence's weights mid-way, but a request samples with one adapter "
                "from start to end: use learner.lora.sync=merged with in_flight, or another mode"
            ),
        )
    if lora.reference_in_learner and cfg.reward.reference_model_path:
        yield (
            "learner.lora.reference",
            (
                f"the learner's reference is its own base with the adapter off, but reward.reference_model_path "
                f"names another model ({cfg.reward.reference_model_path}): set learner.lora.reference=scoring, "
                "which loads that one"
            ),
        )
    yield from check_engines(cfg)


def check_engines(cfg):
    """cluster.rollout_workers: a number or a range; a range only where a node's arrival decides where engines go."""
    c = cfg.cluster
    try:
        low, high = engine_range(c.rollout_workers)
    except ValueError as e:
        yield "cluster.rollout_workers", str(e)
        return
    if low < 1 or high < low:
        yield "cluster.rollout_workers", f"must be >= 1 (a range: 1 <= min <= max), got {c.rollout_workers!r}"
    elif high == low:
        return
    elif c.colocate and c.gpus_per_rollout_worker > 0 and c.gpus_per_learner > 0:
        yield (
            "cluster.rollout_workers",
            "engines colocated on the learner's GPUs stay fixed: give a number, not a range",
        )
    elif c.colocate and not c.rollout_resource:
        yield (
            "cluster.rollout_workers",
            (
                "a range grows onto nodes that join, so engines must ask for what a node brings: set "
                "cluster.rollout_resource (the rollout nodes' custom resource), or cluster.colocate false"
            ),
        )
    elif cfg.rollout.endpoint.enabled:
        yield "cluster.rollout_workers", "the agent endpoint serves a fixed set of engines: give a number, not a range"


def check_data(d, prefix: str = ""):
    """The data section of relay train and of each supervised stage (the same keys)."""
    if not d.train_files and not d.task:
        yield f"{prefix}data.train_files", "give prompt files (JSONL/Parquet), or data.task to generate them"
    if d.train_files and d.task:
        yield f"{prefix}data.task", "give either data.train_files or data.task, not both"
    if d.task and d.eval_files:
        yield (
            f"{prefix}data.eval_files",
            (
                "a task draws its own held-out set (prompts no training set holds): "
                "give eval_files with train_files, not with data.task"
            ),
        )
    if d.task and d.task_size < 1:
        yield f"{prefix}data.task_size", f"must be >= 1, got {d.task_size}"
    if d.eval_size < 1:  # evaluation before and after training needs prompts
        yield f"{prefix}data.eval_size", f"must be >= 1, got {d.eval_size}"


def check_watchdog(w):
    from runtime.watchdog import PHASES

    for phase, seconds in w.phases_s.items():
        if phase not in PHASES:
            yield f"watchdog.phases_s.{phase}", f"no such phase; the phases: {', '.join(sorted(PHASES))}"
        elif seconds <= 0:
            yield f"watchdog.phases_s.{phase}", f"must be > 0 seconds, got {seconds}"
    for key in ("factor", "floor_s", "first_s", "kill_grace_s", "collective_timeout_s"):
        if getattr(w, key) <= 0:
            yield f"watchdog.{key}", f"must be > 0, got {getattr(w, key)}"


def check_checkpoint(c):
    zero = {"every_n_steps": "only at the end", "keep_last": "keep all"}
    for key, means in zero.items():  # a negative keep_last would delete all but the newest
        if getattr(c, key) < 0:
            yield f"checkpoint.{key}", f"must be >= 0 (0: {means}), got {getattr(c, key)}"


def check_eval(cfg):
    e, n = cfg.eval, eval_samples(cfg)
    if e.n_samples < 0:
        yield "eval.n_samples", f"must be >= 1, or 0 for rollout.sampling.n_samples_per_prompt; got {e.n_samples}"
    for k in e.pass_k:
        if not 1 <= k <= n:
            yield "eval.pass_k", f"each k must be in [1, eval.n_samples = {n}] (pass@k draws k of n samples), got {k}"
    names = [suite.name for suite in e.suites]
    for i, suite in enumerate(e.suites):
        key = f"eval.suites.{i}"
        if not suite.name or suite.name in ("greedy", "sampled") or "/" in suite.name or suite.name in names[:i]:
            yield f"{key}.name", f"a unique name without '/' (not greedy or sampled) is needed, got {suite.name!r}"
        if bool(suite.task) == bool(suite.file):
            yield key, "give a task or a file (one of them)"
        if suite.size < 1:
            yield f"{key}.size", f"must be >= 1, got {suite.size}"
        if suite.sources:
            for k, problem in check_rewards(dataclasses.replace(cfg.reward, sources=suite.sources)):
                if k.startswith("reward.sources."):  # the rest is the run's reward section, checked already
                    yield k.replace("reward.sources", f"{key}.sources"), problem


def check_health(h):
    if h.window < 4:
        yield "health.window", f"must be >= 4 (trends compare its halves), got {h.window}"
    if not 1 <= h.patience <= h.window:
        yield "health.patience", f"must be in [1, health.window = {h.window}], got {h.patience}"
    if not 0 <= h.kl_low < h.kl_high:
        yield "health.kl_low", f"must be in [0, health.kl_high = {h.kl_high}), got {h.kl_low}"
    for key in ("entropy_floor", "distinct_floor", "zero_spread_max"):
        if not 0 < getattr(h, key) <= 1:
            yield f"health.{key}", f"must be in (0, 1], got {getattr(h, key)}"
    for key in ("length_rise", "reward_flat", "held_out_drop", "value_loss_factor", "logprob_gap_factor"):
        if getattr(h, key) <= 0:
            yield f"health.{key}", f"must be > 0, got {getattr(h, key)}"

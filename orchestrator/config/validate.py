"""Checks across the whole tree that types alone cannot express. Each yields (key, problem)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

from envs.registry import make_factory
from learner.config import Baseline, CriticInit, Estimator, KLControllerKind, Method, ValueHead
from orchestrator.config.methods import endpoint_incompatible, tree_conflicts
from orchestrator.config.schema import eval_samples
from reward_service.config import SourceKind

GROUPED = {Estimator.grpo, Estimator.rloo}


def validate(cfg) -> Iterator[tuple[str, str]]:
    yield from _sampling(cfg)
    yield from _method(cfg)
    yield from _algorithm(cfg)
    yield from _batches(cfg)
    yield from _learner(cfg)
    yield from _rewards(cfg.reward)
    yield from _cluster(cfg)
    yield from _data(cfg.data)
    yield from _env(cfg)
    yield from _watchdog(cfg.watchdog)
    yield from _eval(cfg)
    yield from _health(cfg.health)


def _health(h):
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


def _eval(cfg):
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
            for k, problem in _rewards(dataclasses.replace(cfg.reward, sources=suite.sources)):
                if k.startswith("reward.sources."):  # the rest is the run's reward section, checked already
                    yield k.replace("reward.sources", f"{key}.sources"), problem


def validate_stage(cfg, prefix: str = "") -> Iterator[tuple[str, str]]:
    """relay sft / relay rm."""
    t = cfg.train
    yield from _data(cfg.data, prefix)
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


def validate_pipeline(cfg) -> Iterator[tuple[str, str]]:
    """The stages; the PPO section is checked once the earlier stages have given it its paths."""
    yield from validate_stage(cfg.sft, "sft.")
    yield from validate_stage(cfg.rm, "rm.")


def validate_reward(reward) -> Iterator[tuple[str, str]]:
    """For commands that use the reward section alone (relay serve-reward)."""
    yield from _rewards(reward)


def _sampling(cfg):
    s = cfg.rollout.sampling
    if s.temperature <= 0:
        yield (
            "rollout.sampling.temperature",
            (
                f"must be > 0 for training, got {s.temperature}: the update needs the distribution the samples were "
                "drawn from (log-probabilities at temperature 0 are undefined); greedy decoding belongs to "
                "evaluation (eval.greedy)"
            ),
        )
    if not 0 < s.top_p <= 1:
        yield "rollout.sampling.top_p", f"must be in (0, 1], got {s.top_p}"
    if s.top_k == 0 or s.top_k < -1:
        yield "rollout.sampling.top_k", f"must be -1 (off) or >= 1, got {s.top_k}"
    if s.repetition_penalty != 1.0:
        yield (
            "rollout.sampling.repetition_penalty",
            (
                f"must be 1.0 (off) for training, got {s.repetition_penalty}: the learner cannot reproduce the "
                "penalty, so the behaviour logprobs would be of another distribution than the policy it trains"
            ),
        )
    if s.max_new_tokens < 1:
        yield "rollout.sampling.max_new_tokens", f"must be >= 1, got {s.max_new_tokens}"
    if s.n_samples_per_prompt < 1:
        yield "rollout.sampling.n_samples_per_prompt", f"must be >= 1, got {s.n_samples_per_prompt}"
    r = cfg.rollout
    if r.max_prompt_tokens + s.max_new_tokens > r.max_model_len:
        yield (
            "rollout.max_model_len",
            (f"{r.max_model_len} < max_prompt_tokens ({r.max_prompt_tokens}) + max_new_tokens ({s.max_new_tokens})"),
        )


def _batches(cfg):
    a, n = cfg.algorithm, cfg.rollout.sampling.n_samples_per_prompt
    samples = cfg.data.rollout_batch_size * n
    ranks = cfg.cluster.learner_ranks
    if cfg.data.rollout_batch_size < 1:
        yield "data.rollout_batch_size", "must be >= 1"
    if a.mini_batch_size < 1 or samples % a.mini_batch_size:
        yield (
            "algorithm.mini_batch_size",
            (
                f"{a.mini_batch_size} must divide the samples per step: data.rollout_batch_size "
                f"({cfg.data.rollout_batch_size}) x rollout.sampling.n_samples_per_prompt ({n}) = {samples}"
            ),
        )
    elif a.micro_batch_size < 1 or a.mini_batch_size % (a.micro_batch_size * ranks):
        yield (
            "algorithm.micro_batch_size",
            (
                f"micro_batch_size ({a.micro_batch_size}) x cluster.learner_ranks ({ranks}) must divide "
                f"algorithm.mini_batch_size ({a.mini_batch_size})"
            ),
        )


def _method(cfg):
    """A named recipe: one the agent endpoint cannot serve is refused as such (not by the keys it sets,
    whose errors would ask for n >= 2 and n = 1 in turn); else the tree must hold every key it sets."""
    m = cfg.algorithm.method
    if m != Method.none and cfg.rollout.endpoint.enabled and endpoint_incompatible(m):
        yield (
            "algorithm.method",
            (
                f"algorithm.method={m.value} is incompatible with the agent endpoint: it compares "
                "or regenerates the samples of one prompt, and each episode is its own prompt; "
                "use reinforce_pp, or none with estimator reinforce_baseline, baseline batch"
            ),
        )
        return
    yield from tree_conflicts(cfg)


def _algorithm(cfg):
    a, n = cfg.algorithm, cfg.rollout.sampling.n_samples_per_prompt
    if n < 2 and not cfg.rollout.endpoint.enabled:  # the endpoint's n is 1: _endpoint says why that cannot work
        yield from group_baselines(a, n).items()
    for key, value in (
        ("gae.gamma", a.gae.gamma),
        ("gae.lam", a.gae.lam),
        ("reinforce_pp.gamma", a.reinforce_pp.gamma),
    ):
        if not 0 <= value <= 1:
            yield f"algorithm.{key}", f"must be in [0, 1], got {value}"
    if a.clip_eps <= 0:
        yield "algorithm.clip_eps", f"must be > 0, got {a.clip_eps}"
    if a.clip_eps_high < 0:
        yield "algorithm.clip_eps_high", f"must be >= 0 (0 = clip_eps), got {a.clip_eps_high}"
    if not 0 <= a.cispo.clip_low < 1:
        yield "algorithm.cispo.clip_low", f"must be in [0, 1) (0 = no lower bound), got {a.cispo.clip_low}"
    if a.loss_norm_tokens < 0:
        yield "algorithm.loss_norm_tokens", f"must be >= 0 (0 = a sample's token budget), got {a.loss_norm_tokens}"
    if a.max_skipped_updates < 0:
        yield "algorithm.max_skipped_updates", f"must be >= 0 (0 = never stop), got {a.max_skipped_updates}"
    if a.ppo_epochs < 1:
        yield "algorithm.ppo_epochs", f"must be >= 1, got {a.ppo_epochs}"
    if a.init_kl_coef < 0:
        yield "algorithm.init_kl_coef", f"must be >= 0, got {a.init_kl_coef}"
    o = a.off_policy
    if o.cap <= 0:
        yield "algorithm.off_policy.cap", f"must be > 0, got {o.cap}"
    if not 0 <= o.low < 1 < o.high:
        yield "algorithm.off_policy.low", f"need 0 <= low < 1 < high, got low {o.low}, high {o.high}"
    if a.kl_controller == KLControllerKind.adaptive:
        if a.target_kl <= 0:
            yield "algorithm.target_kl", f"the adaptive controller needs a target > 0, got {a.target_kl}"
        if a.kl_horizon < 1:
            yield "algorithm.kl_horizon", f"must be >= 1, got {a.kl_horizon}"
        if a.init_kl_coef == 0:
            yield "algorithm.init_kl_coef", "an adaptive controller cannot move a coefficient of 0"


def group_baselines(a, n: int) -> dict[str, str]:
    """{key: problem with n samples per prompt} for each setting of `a` that compares the samples of one prompt."""
    out = {}
    if a.estimator in GROUPED:
        out["rollout.sampling.n_samples_per_prompt"] = (
            f"{a.estimator.value} compares samples of one prompt: needs >= 2, got {n}"
        )
    need = f"a group baseline needs >= 2 samples per prompt (rollout.sampling.n_samples_per_prompt is {n})"
    if a.estimator == Estimator.reinforce_baseline and a.reinforce_baseline.baseline == Baseline.group:
        out["algorithm.reinforce_baseline.baseline"] = need + "; use batch"
    if a.estimator == Estimator.reinforce_pp and a.reinforce_pp.group_baseline:
        out["algorithm.reinforce_pp.group_baseline"] = need
    return out


def _learner(cfg):
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


def _judge(src, key: str):
    if bool(src.model_path) == bool(src.url):
        yield key, "a judge needs model_path (a model folder run in the scoring service) or url (OpenAI-compatible)"
    if "{response}" not in src.template:
        yield f"{key}.template", "must hold {response} (and may hold {prompt} and {answer})"
    if src.verdict not in ("choice", "number", "probability"):
        yield f"{key}.verdict", f"must be choice, number or probability, got {src.verdict!r}"
    if src.verdict in ("choice", "probability") and not src.choices:
        yield f"{key}.choices", "a choice verdict needs its words and their scores, e.g. {yes: 1.0, no: 0.0}"
    if src.verdict == "number" and not (len(src.score_range) == 2 and src.score_range[0] < src.score_range[1]):
        yield f"{key}.score_range", f"must be [low, high] with low < high, got {list(src.score_range)}"
    if src.timeout_s <= 0:
        yield f"{key}.timeout_s", "a judge needs a deadline > 0"
    if src.judge_max_tokens < 1:
        yield f"{key}.judge_max_tokens", f"must be >= 1, got {src.judge_max_tokens}"
    if not 0 <= src.judge_min_choice_mass <= 1:
        yield f"{key}.judge_min_choice_mass", f"must be in [0, 1], got {src.judge_min_choice_mass}"
    if src.judge_engine not in ("vllm", "transformers"):
        yield f"{key}.judge_engine", f"must be vllm or transformers, got {src.judge_engine!r}"
    if src.model_path and src.judge_engine == "vllm":
        if src.judge_max_model_len and src.judge_max_model_len <= src.judge_max_tokens:
            yield (
                f"{key}.judge_max_model_len",
                "must be 0 (the model's) or exceed judge_max_tokens (room for the prompt)",
            )
        if src.judge_kv_cache_gb < 1:
            yield f"{key}.judge_kv_cache_gb", f"must be >= 1 (GiB), got {src.judge_kv_cache_gb}"
        if not 0 < src.judge_gpu_memory_utilization <= 1:
            yield f"{key}.judge_gpu_memory_utilization", f"must be in (0, 1], got {src.judge_gpu_memory_utilization}"


def _rewards(reward):
    if not reward.sources:
        yield "reward.sources", "at least one reward source is needed"
    needs = {
        SourceKind.function: "function",
        SourceKind.reward_model: "model_path",
        SourceKind.remote: "url",
        SourceKind.format: "pattern",
        SourceKind.length_penalty: "target_length",
    }
    for i, src in enumerate(reward.sources):
        field = needs.get(src.kind)
        if field and not getattr(src, field):
            yield f"reward.sources.{i}.{field}", f"a {src.kind.value} source needs {field}"
        if src.kind == SourceKind.function and field and ":" not in src.function:
            yield f"reward.sources.{i}.function", f"expected 'module.path:function', got {src.function!r}"
        if src.kind == SourceKind.remote and src.timeout_s <= 0:
            yield f"reward.sources.{i}.timeout_s", "a remote reward needs a deadline > 0"
        if src.kind == SourceKind.judge:
            yield from _judge(src, f"reward.sources.{i}")
    if reward.max_unjudged_steps < 0:
        yield "reward.max_unjudged_steps", f"must be >= 0 (0 = never stop), got {reward.max_unjudged_steps}"
    if reward.overlong_buffer < 0:
        yield "reward.overlong_buffer", f"must be >= 0 (0 = off), got {reward.overlong_buffer}"
    if reward.overlong_buffer > 0 and not 0 < reward.overlong_buffer <= reward.overlong_max_tokens:
        yield (
            "reward.overlong_max_tokens",
            (
                f"overlong shaping needs overlong_max_tokens >= overlong_buffer "
                f"({reward.overlong_buffer}), got {reward.overlong_max_tokens}"
            ),
        )
    if reward.clip < 0:
        yield "reward.clip", f"must be >= 0 (0 = off), got {reward.clip}"


def _cluster(cfg):
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
    for key in ("rollout_workers", "learner_ranks"):
        if getattr(c, key) < 1:
            yield f"cluster.{key}", f"must be >= 1, got {getattr(c, key)}"


def _watchdog(w):
    from runtime.watchdog import PHASES

    for phase, seconds in w.phases_s.items():
        if phase not in PHASES:
            yield f"watchdog.phases_s.{phase}", f"no such phase; the phases: {', '.join(sorted(PHASES))}"
        elif seconds <= 0:
            yield f"watchdog.phases_s.{phase}", f"must be > 0 seconds, got {seconds}"
    for key in ("factor", "floor_s", "first_s", "kill_grace_s", "collective_timeout_s"):
        if getattr(w, key) <= 0:
            yield f"watchdog.{key}", f"must be > 0, got {getattr(w, key)}"


def _data(d, prefix: str = ""):
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


def _env(cfg):
    e, r = cfg.env, cfg.rollout
    uses_env_reward = any(src.kind == SourceKind.environment for src in cfg.reward.sources)
    if r.endpoint.enabled:
        yield from _endpoint(cfg)
    if not e.name:
        if uses_env_reward and not r.endpoint.enabled:
            yield "reward.sources", "an environment source needs an environment (env.name) or the agent endpoint"
        return
    if r.endpoint.enabled:
        yield "env.name", "the agent endpoint's episodes are the agent program's own: no environment with it"
    try:
        make_factory(e.name, e.options)  # an unknown class or bad options fail here, not in every engine
    except ValueError as err:
        key, _, why = str(err).partition(": ")
        yield key, why
    if e.max_turns < 1:
        yield "env.max_turns", f"must be >= 1, got {e.max_turns}"
    if e.max_episode_tokens < 0:
        yield "env.max_episode_tokens", f"must be >= 0 (0 = max_turns * max_new_tokens), got {e.max_episode_tokens}"
    if e.step_timeout_s <= 0:
        yield "env.step_timeout_s", f"an environment needs a deadline > 0, got {e.step_timeout_s}"
    budget = e.response_tokens(r.sampling.max_new_tokens)
    if r.max_prompt_tokens + budget > r.max_model_len:
        yield (
            "rollout.max_model_len",
            (
                f"{r.max_model_len} < max_prompt_tokens ({r.max_prompt_tokens}) + the episode's "
                f"tokens ({budget}, env.max_episode_tokens or max_turns * max_new_tokens)"
            ),
        )


def _endpoint(cfg):
    if cfg.rollout.sampling.n_samples_per_prompt != 1:
        yield (
            "rollout.sampling.n_samples_per_prompt",
            (
                "must be 1 with the agent endpoint: each episode is its "
                "own prompt (use a batch baseline, e.g. estimator "
                "reinforce_baseline with reinforce_baseline.baseline batch)"
            ),
        )
    for key in group_baselines(cfg.algorithm, 1):
        yield (
            "algorithm.estimator" if key.startswith("rollout.") else key,
            "compares the samples of one prompt, and each agent endpoint episode is its own prompt: use estimator "
            "reinforce_baseline with reinforce_baseline.baseline batch, or reinforce_pp",
        )
    if cfg.data.dynamic_sampling:
        yield "data.dynamic_sampling", "the agent endpoint's episodes cannot be regenerated: turn it off"
    if cfg.async_training.mode.value != "sync":
        yield (
            "async_training.mode",
            ("the agent endpoint is asynchronous by itself (agents call while the learner trains): use sync"),
        )
    if cfg.rollout.endpoint.max_staleness < 0:
        yield "rollout.endpoint.max_staleness", f"must be >= 0, got {cfg.rollout.endpoint.max_staleness}"
    template = cfg.rollout.endpoint.chat_template
    if template and not Path(template).is_file():
        yield "rollout.endpoint.chat_template", f"no such file: {template}"
    c = cfg.cluster
    if c.colocate and c.gpus_per_rollout_worker > 0 and c.gpus_per_learner > 0:  # as Roles.sleep_engines
        yield (
            "cluster.colocate",
            (
                "the agent endpoint serves agents while the learner trains, but engines "
                "colocated with the learner on GPUs (cluster.gpus_per_rollout_worker and "
                "gpus_per_learner > 0) sleep during each update: set cluster.colocate false"
            ),
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

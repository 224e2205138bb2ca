"""Rules for the rollout side: sampling, the environment its workers play, the agent endpoint."""

from __future__ import annotations

from pathlib import Path

from envs.registry import make_factory
from orchestrator.config.rules_algorithm import group_baselines
from reward_service.config import SourceKind
from runtime.endpoint_auth import ENDPOINT_KEY_ENV, env_key, keyless_exposure


def check_sampling(cfg):
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


def check_env(cfg):
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
    exposed = keyless_exposure(cfg.rollout.endpoint.host, env_key(ENDPOINT_KEY_ENV), ENDPOINT_KEY_ENV)
    if exposed:  # anyone reaching it could post rewards that train the policy
        yield "rollout.endpoint.host", exposed
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

"""Rules for the algorithm section: the named method, the estimator's settings, the batch sizes."""

from __future__ import annotations

from learner.config import Baseline, Estimator, KLControllerKind, Method
from orchestrator.config.methods import endpoint_incompatible, tree_conflicts

GROUPED = {Estimator.grpo, Estimator.rloo}


def check_method(cfg):
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


def check_algorithm(cfg):
    a, n = cfg.algorithm, cfg.rollout.sampling.n_samples_per_prompt
    if n < 2 and not cfg.rollout.endpoint.enabled:  # the endpoint's n is 1: rules_rollout says why that cannot work
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


def check_batches(cfg):
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

"""`algorithm.method`: a named recipe sets, together, the keys its paper fixes.

Keys are dotted from the train config's root. Keys a recipe does not list stay the user's (e.g.
CISPO's upper clip, DAPO's overlong shaping length, the KL coefficient of RLOO and REINFORCE++).
A key the user sets to another value than the recipe's is refused, naming the key: a half-applied
recipe silently computes something else (Dr. GRPO with a batch std is no longer Dr. GRPO).
"""

from __future__ import annotations

import operator
from collections.abc import Iterator

from learner.config import Estimator, KLEstimator, KLPlacement, LossAggregation, Method, PolicyLoss

_GROUP_NORMALISED = {"algorithm.estimator": Estimator.grpo, "algorithm.grpo.scale_by_std": True}

RECIPES: dict[Method, dict[str, object]] = {
    Method.none: {},
    # Shao et al. 2024 (DeepSeekMath): (r - mean) / std per group, 1/|o_i| per sequence, k3 KL in the loss
    Method.grpo: {
        **_GROUP_NORMALISED,
        "algorithm.policy_loss": PolicyLoss.ppo,
        "algorithm.loss_aggregation": LossAggregation.seq_mean,
        "algorithm.kl_placement": KLPlacement.loss,
        "algorithm.kl_estimator": KLEstimator.k3,
    },
    # Liu et al. 2025: r - mean per group and nothing else (no group std, no batch std), token sums / a constant
    Method.dr_grpo: {
        "algorithm.estimator": Estimator.grpo,
        "algorithm.grpo.scale_by_std": False,
        "algorithm.normalize_advantages": False,
        "algorithm.policy_loss": PolicyLoss.ppo,
        "algorithm.loss_aggregation": LossAggregation.seq_sum_norm,
    },
    # Yu et al. 2025: clip-higher, token-level loss, no KL term, groups of equal rewards resampled
    Method.dapo: {
        **_GROUP_NORMALISED,
        "algorithm.policy_loss": PolicyLoss.ppo,
        "algorithm.loss_aggregation": LossAggregation.token_mean,
        "algorithm.clip_eps": 0.2,
        "algorithm.clip_eps_high": 0.28,
        "algorithm.init_kl_coef": 0.0,
        "data.dynamic_sampling": True,
    },
    # Zheng et al. 2025: group-normalised advantages, sequence ratios, the paper's clip range
    Method.gspo: {
        **_GROUP_NORMALISED,
        "algorithm.policy_loss": PolicyLoss.gspo,
        "algorithm.loss_aggregation": LossAggregation.seq_mean,
        "algorithm.clip_eps": 3e-4,
        "algorithm.clip_eps_high": 4e-4,
    },
    # MiniMax-M1 2025: group-normalised advantages, weights clipped above only, token-level loss
    Method.cispo: {
        **_GROUP_NORMALISED,
        "algorithm.policy_loss": PolicyLoss.cispo,
        "algorithm.loss_aggregation": LossAggregation.token_mean,
        "algorithm.cispo.clip_low": 0.0,
    },
    # Hu 2025: r on the last token, -beta * log(pi/pi_ref) (k1) on every token, reward-to-go whitened over the batch
    Method.reinforce_pp: {
        "algorithm.estimator": Estimator.reinforce_pp,
        "algorithm.kl_placement": KLPlacement.reward,
        "algorithm.kl_estimator": KLEstimator.k1,
        "algorithm.normalize_advantages": True,
        "algorithm.policy_loss": PolicyLoss.ppo,
        "algorithm.loss_aggregation": LossAggregation.token_mean,
    },
    # Ahmadian et al. 2024: the whole response is one action: (R - beta * sum log(pi/pi_ref)) minus the mean of
    # the other samples, not normalised, times the response's summed logprob (a constant divides it)
    Method.rloo: {
        "algorithm.estimator": Estimator.rloo,
        "algorithm.normalize_advantages": False,
        "algorithm.kl_placement": KLPlacement.reward,
        "algorithm.kl_estimator": KLEstimator.k1,
        "algorithm.policy_loss": PolicyLoss.ppo,
        "algorithm.loss_aggregation": LossAggregation.seq_sum_norm,
    },
}


def recipe_conflicts(method: Method, get, given: set[str], prefix: str = "") -> Iterator[tuple[str, str]]:
    """(key, problem) for each key of `method`'s recipe the user gave (`given`, dotted keys) with another
    value; `get(key)` reads the merged config. `prefix` places the train config in a larger tree."""
    for key, want in RECIPES[method].items():
        got = get(prefix + key)
        if prefix + key in given and got != want:
            yield (
                prefix + key,
                (
                    f"algorithm.method={method.value} sets it to {_show(want)}, got {_show(got)}: "
                    "drop the key, or use algorithm.method=none and set every key yourself"
                ),
            )


def tree_conflicts(cfg) -> Iterator[tuple[str, str]]:
    """(key, problem) for each key of cfg.algorithm.method's recipe that the built tree (a TrainConfig)
    holds with another value: a config made in code, where no loader applied the recipe."""
    method = cfg.algorithm.method
    yield from recipe_conflicts(method, lambda key: operator.attrgetter(key)(cfg), set(RECIPES[method]))


def endpoint_incompatible(method: Method) -> bool:
    """The recipe compares the samples of one prompt (group advantages) or regenerates them (dynamic
    sampling), which the agent endpoint's episodes (one sample each, not regenerable) cannot give."""
    recipe = RECIPES[method]
    grouped = recipe.get("algorithm.estimator") in (Estimator.grpo, Estimator.rloo)
    return grouped or bool(recipe.get("data.dynamic_sampling"))


def _show(value) -> str:
    """As the user writes it: an enum by its value, a bool in YAML's spelling."""
    return str(value).lower() if isinstance(value, bool) else str(getattr(value, "value", value))

"""Policy losses beside PPO's (GSPO, CISPO), their dispatch table, and the REINFORCE++ estimator.

Pure functions on tensors with learner/algorithms.py's conventions (shapes B = samples, T = response
tokens; `mask` (B, T) 1.0 on response tokens; padding never changes a result). This module imports
torch and learner.algorithms only (tests/test_architecture.py).

Every policy loss has ppo_policy_loss's signature: (logprobs, old_logprobs, advantages (B, T), mask,
clip_eps, clip_eps_high, aggregation, total, weights, norm_tokens) -> (loss, metrics with clip_frac,
approx_kl and ratio_mean). `weights` (B, T), detached, multiply each token's term (off-policy
correction) as in PPO.
"""

from __future__ import annotations

import torch
from torch import Tensor

from learner import algorithms as A


def gspo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float,
    clip_eps_high: float | None = None,
    aggregation: str = "token_mean",
    total: float | None = None,
    weights: Tensor | None = None,
    norm_tokens: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025), in its GSPO-token form: one ratio per sequence,
    s_i = exp(mean over its tokens of (logp - old_logp)), clipped to [1 - clip_eps, 1 + clip_eps_high]
    as PPO clips a token's. Token t's term uses s_i,t = sg(s_i) * exp(logp_t - sg(logp_t)): its value
    is s_i, its gradient sg(s_i) * grad logp_t, so with seq_mean aggregation (the paper's 1/|y_i|)
    the gradient is GSPO's. The paper's clip ranges are tiny (3e-4, 4e-4): a sequence ratio moves less.
    """
    lp = torch.where(mask > 0, logprobs.float(), 0.0)  # padding may hold -inf: keep it out of lp - sg(lp)
    log_ratio = torch.where(mask > 0, lp - old_logprobs.float(), 0.0)
    seq_log_ratio = A.masked_mean(log_ratio, mask, dim=-1)  # (B,) log s_i
    ratio = (seq_log_ratio.detach()[:, None] + lp - lp.detach()).exp()  # s_i,t
    return A.clipped_surrogate(
        ratio, log_ratio, advantages, mask, clip_eps, clip_eps_high, aggregation, total, weights, norm_tokens
    )


def cispo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float | None,
    clip_eps_high: float | None = None,
    aggregation: str = "token_mean",
    total: float | None = None,
    weights: Tensor | None = None,
    norm_tokens: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, 2025): REINFORCE with a clipped importance weight, per token
    -sg(clamp(ratio, 1 - clip_eps, 1 + clip_eps_high)) * A * logp. The clip cuts the weight, never the
    gradient: every token's logp keeps one (PPO zeroes the clipped tokens'). clip_eps None: no lower
    bound, as in the paper (its epsilon_low is set large: low-ratio tokens are the rare forks that
    the update should keep); clip_eps_high None: clip_eps.
    """
    high = clip_eps if clip_eps_high is None else clip_eps_high
    if high is None:
        raise ValueError("CISPO needs an upper bound: clip_eps_high (or clip_eps)")
    lp = torch.where(mask > 0, logprobs.float(), 0.0)
    log_ratio = torch.where(mask > 0, lp - old_logprobs.float(), 0.0)
    ratio = log_ratio.exp()
    low = None if clip_eps is None else 1.0 - clip_eps
    weight = ratio.detach().clamp(min=low, max=1.0 + high)
    per_token = -weight * advantages * lp
    loss = A.aggregate(per_token if weights is None else per_token * weights, mask, aggregation, total, norm_tokens)
    return loss, A.ratio_metrics(log_ratio, ratio, weight != ratio.detach(), mask)


# algorithm.policy_loss -> the loss (one signature, above)
POLICY_LOSSES = {"ppo": A.ppo_policy_loss, "gspo": gspo_policy_loss, "cispo": cispo_policy_loss}


def reinforce_pp_returns(
    scores: Tensor,
    kl: Tensor,
    kl_coef: float,
    mask: Tensor,
    gamma: float,
    group_size: int = 1,
    valid: Tensor | None = None,
    group_baseline: bool = False,
) -> Tensor:
    """REINFORCE++ (Hu 2025; OpenRLHF's `reinforce`, and `reinforce_baseline` with group_baseline):
    token rewards are the sequence score (B,) on the last response token minus kl_coef * each token's
    KL (B, T); the advantage is their discounted reward-to-go (B, T), 0 on padding. group_baseline:
    the score minus its group's mean first (0 for dropped samples and groups with one valid sample).
    The whitening over the whole batch (not per group) is experience.normalize's, as for GAE.
    """
    if group_baseline:
        scores = A.reinforce_baseline_advantages(scores, group_size, valid, "group")
    return A.discounted_returns(A.token_rewards(scores, kl, kl_coef, mask), mask, gamma)

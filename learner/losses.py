"""Policy losses beside PPO's (GSPO, CISPO) and their dispatch table.

Pure functions on tensors with learner/algorithms.py's conventions (shapes B = samples, T = response
tokens; `mask` (B, T) 1.0 on response tokens; padding never changes a result). This module imports
torch and learner.algorithms only (tests/unit/test_architecture.py).

Every policy loss has ppo_policy_loss's signature: (algorithms.PolicyLossInput, clip_eps, clip_eps_high)
-> (loss, metrics with clip_frac, approx_kl and ratio_mean). Its `weights` (B, T), detached, multiply
each token's term (off-policy correction) as in PPO.
"""

from __future__ import annotations

import torch
from torch import Tensor

from learner import algorithms as A


def gspo_policy_loss(
    x: A.PolicyLossInput, clip_eps: float, clip_eps_high: float | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025), in its GSPO-token form: one ratio per sequence,
    s_i = exp(mean over its tokens of (logp - old_logp)), clipped to [1 - clip_eps, 1 + clip_eps_high]
    as PPO clips a token's. Token t's term uses s_i,t = sg(s_i) * exp(logp_t - sg(logp_t)): its value
    is s_i, its gradient sg(s_i) * grad logp_t, so with seq_mean aggregation (the paper's 1/|y_i|)
    the gradient is GSPO's. The paper's clip ranges are tiny (3e-4, 4e-4): a sequence ratio moves less.
    """
    mask = x.mask
    lp = torch.where(mask > 0, x.logprobs.float(), 0.0)  # padding may hold -inf: keep it out of lp - sg(lp)
    log_ratio = torch.where(mask > 0, lp - x.old_logprobs.float(), 0.0)
    seq_log_ratio = A.masked_mean(log_ratio, mask, dim=-1)  # (B,) log s_i
    ratio = (seq_log_ratio.detach()[:, None] + lp - lp.detach()).exp()  # s_i,t
    return A.clipped_surrogate(ratio, log_ratio, x, clip_eps, clip_eps_high)


def cispo_policy_loss(
    x: A.PolicyLossInput, clip_eps: float | None, clip_eps_high: float | None = None
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
    mask = x.mask
    lp = torch.where(mask > 0, x.logprobs.float(), 0.0)
    log_ratio = torch.where(mask > 0, lp - x.old_logprobs.float(), 0.0)
    ratio = log_ratio.exp()
    low = None if clip_eps is None else 1.0 - clip_eps
    weight = ratio.detach().clamp(min=low, max=1.0 + high)
    per_token = -weight * x.advantages * lp
    weighted = per_token if x.weights is None else per_token * x.weights
    loss = A.aggregate(weighted, mask, x.aggregation, x.total, x.norm_tokens)
    return loss, A.ratio_metrics(log_ratio, ratio, weight != ratio.detach(), mask)


# algorithm.policy_loss -> the loss (one signature, above)
POLICY_LOSSES = {"ppo": A.ppo_policy_loss, "gspo": gspo_policy_loss, "cispo": cispo_policy_loss}

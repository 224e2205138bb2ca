"""The RL math of relay: advantage estimators, policy/value losses, KL estimators (the off-policy
corrections are learner/off_policy.py's).

Pure functions on tensors. Shapes: B = samples, T = response tokens. Every token-level function takes
`mask` (B, T), 1.0 on response tokens and 0.0 on padding, and padding never changes a result.
This module imports torch and nothing distributed, no model and no config (tests/unit/test_architecture.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from runtime.logprobs import logprobs_from_logits

# ---------------------------------------------------------------- masked statistics


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean over the unmasked entries; 0 where nothing is unmasked."""
    count = mask.sum() if dim is None else mask.sum(dim)
    # where() keeps padding garbage (even inf/nan) out of the sum, not only zero-weighted
    return masked_sum(torch.where(mask > 0, x, 0.0), mask, dim) / count.clamp(min=1e-8)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    n = mask.sum()
    if unbiased and n > 1:
        var = var * n / (n - 1)
    return var


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(x - mean) / std over unmasked entries (unbiased variance); padding comes out 0.

    shift_mean=False keeps the mean and only rescales (used for rewards, whose sign carries meaning).
    """
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask > 0, out, 0.0)


def masked_rescale(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """x / std over unmasked entries, without shifting: a zero stays exactly zero (for advantages
    already centred per group, where a batch mean shift would move an all-equal group off 0)."""
    return torch.where(mask > 0, x * torch.rsqrt(masked_var(x, mask) + eps), 0.0)


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """1 - Var(returns - values) / Var(returns): 1 is a perfect critic, 0 no better than a constant."""
    return 1.0 - masked_var(returns - values, mask) / masked_var(returns, mask).clamp(min=1e-8)


# ---------------------------------------------------------------- KL to the reference policy


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str, mask: Tensor | None = None) -> Tensor:
    """Per-token estimate of KL(policy || reference) from tokens sampled by the policy.

    Schulman's estimators with log r = ref - policy: k1 = -log r (unbiased, can be negative),
    k2 = (log r)^2 / 2 (biased, >= 0), k3 = (r - 1) - log r (unbiased, >= 0).
    """
    log_ratio = logprobs.float() - ref_logprobs.float()
    if kind == "k1":
        kl = log_ratio
    elif kind == "k2":
        kl = 0.5 * log_ratio**2
    elif kind == "k3":
        neg = (-log_ratio).clamp(-20.0, 20.0)  # exp of a large ratio would overflow to inf
        kl = neg.exp() - 1.0 - neg
    else:
        raise ValueError(f"unknown KL estimator {kind!r}; expected k1, k2 or k3")
    return kl if mask is None else torch.where(mask > 0, kl, 0.0)


def sequence_kl(kl: Tensor, mask: Tensor) -> Tensor:
    """Per-token KL (B, T) summed over each response, averaged over the rows with a response token:
    the unit of the adaptive controller's target (Ziegler et al. 2019; TRL's `target`)."""
    has_token = (mask.sum(-1) > 0).float()
    return masked_mean(masked_sum(torch.where(mask > 0, kl, 0.0), mask, dim=-1), has_token)


def token_rewards(scores: Tensor, kl: Tensor, kl_coef: float, mask: Tensor) -> Tensor:
    """Per-token reward (B, T): -kl_coef * KL on every response token, plus the sequence score (B,)
    on the last response token. Rows with no response token get nothing."""
    rewards = torch.where(mask > 0, -kl_coef * kl, 0.0)
    last = last_token_index(mask)
    has_token = mask.sum(-1) > 0
    return rewards.scatter_add(1, last.unsqueeze(1), torch.where(has_token, scores, 0.0).unsqueeze(1).to(rewards))


def last_token_index(mask: Tensor) -> Tensor:
    """Index of the last unmasked position per row (B,); 0 for an all-padding row."""
    T = mask.shape[-1]
    return (T - 1 - (mask > 0).flip(-1).int().argmax(-1)).where(mask.sum(-1) > 0, 0)


# ---------------------------------------------------------------- advantage estimators


def compute_gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over the unmasked tokens of each row.

    Padding anywhere (left, right, holes) is skipped: a token's successor is the next unmasked token,
    and the value after the last one is 0 (the episode ends). Returns (advantages, returns), 0 on padding.
    """
    B, T = rewards.shape
    rewards = torch.where(mask > 0, rewards.float(), 0.0)
    values = torch.where(mask > 0, values.float(), 0.0)
    m = (mask > 0).float()
    advantages = torch.zeros_like(rewards)
    next_value = rewards.new_zeros(B)
    running = rewards.new_zeros(B)
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        gae = delta + gamma * lam * running
        running = m[:, t] * gae + (1 - m[:, t]) * running
        next_value = m[:, t] * values[:, t] + (1 - m[:, t]) * next_value
        advantages[:, t] = m[:, t] * running
    return advantages, (advantages + values) * m


def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """Reward-to-go sum_{k>=t} gamma^(k-t) r_k over unmasked tokens, 0 on padding (B, T)."""
    returns, _ = compute_gae(rewards, torch.zeros_like(rewards, dtype=torch.float), mask, gamma, 1.0)
    return returns


def _groups(scores: Tensor, group_size: int, valid: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """(scores (G, n), valid (G, n) as 0/1, valid members per group (G, 1))."""
    if group_size < 1 or scores.numel() % group_size:
        raise ValueError(f"{scores.numel()} scores do not split into groups of {group_size}")
    g = scores.float().view(-1, group_size)
    v = torch.ones_like(g) if valid is None else valid.float().view(-1, group_size)
    return torch.where(v > 0, g, 0.0), v, v.sum(-1, keepdim=True)


def grpo_advantages(
    scores: Tensor, group_size: int, valid: Tensor | None = None, scale_by_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """GRPO (Shao et al. 2024): each score minus its group's mean, over the group's std (unbiased).

    scores (B,) hold the samples of one prompt contiguously, B = prompts * group_size. `valid` (B,)
    takes dropped samples out of their group: they get 0 and enter neither mean nor std. A group
    whose scores are all equal, or with fewer than 2 valid samples, gets 0 (nothing to learn).
    """
    g, v, n = _groups(scores, group_size, valid)
    centred = (g - g.sum(-1, keepdim=True) / n.clamp(min=1)) * v
    # equal finite scores: exactly 0, not their mean's float32 rounding over (std + eps), a few hundredths for every
    # sample (eight 0.1s: -0.0074 each); normalised rewards are such scores. A NaN or inf stays, for the learner's check
    top = torch.where(v > 0, g, -float("inf")).amax(-1, keepdim=True)
    equal = (top == torch.where(v > 0, g, float("inf")).amin(-1, keepdim=True)) & top.isfinite()
    centred = torch.where(equal, 0.0, centred)
    if scale_by_std:
        std = ((centred**2).sum(-1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()
        centred = centred / (std + eps)
    return torch.where(n >= 2, centred, 0.0).view(-1)


def rloo_advantages(scores: Tensor, group_size: int, valid: Tensor | None = None) -> Tensor:
    """REINFORCE leave-one-out (Ahmadian et al. 2024): score minus the mean of the group's other
    valid samples; 0 for dropped samples and for groups with fewer than 2 valid ones."""
    if group_size < 2:
        raise ValueError("RLOO needs at least 2 samples per prompt")
    g, v, n = _groups(scores, group_size, valid)
    others_mean = (g.sum(-1, keepdim=True) - g) / (n - 1).clamp(min=1)
    return torch.where(n >= 2, (g - others_mean) * v, 0.0).view(-1)


def reinforce_baseline_advantages(
    scores: Tensor, group_size: int = 1, valid: Tensor | None = None, baseline: str = "group"
) -> Tensor:
    """REINFORCE with a baseline: score minus the mean score of the valid samples of its group
    (baseline "group", REINFORCE++-baseline's; 0 where a group has one valid sample) or of the
    whole batch ("batch"). Dropped samples get 0."""
    if baseline == "batch":
        return reinforce_baseline_advantages(scores, scores.numel(), valid, "group")
    if baseline != "group":
        raise ValueError(f"unknown REINFORCE baseline {baseline!r}; expected group or batch")
    g, v, n = _groups(scores, group_size, valid)
    return torch.where(n >= 2, (g - g.sum(-1, keepdim=True) / n.clamp(min=1)) * v, 0.0).view(-1)


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
        scores = reinforce_baseline_advantages(scores, group_size, valid, "group")
    return discounted_returns(token_rewards(scores, kl, kl_coef, mask), mask, gamma)


# ---------------------------------------------------------------- one interface for every estimator


@dataclass
class EstimatorInput:
    """What every advantage estimator reads; each takes this and its own options (keywords) and returns
    (advantages (B, T), returns (B, T) or None: value targets, for the estimator with a critic)."""

    scores: Tensor  # (B,) each sample's score; one prompt's samples contiguous
    kl: Tensor  # (B, T) per-token KL to the reference
    kl_coef: float  # the KL penalty's coefficient
    kl_in_reward: bool  # the KL penalty goes into the reward (else into the loss, and estimators ignore it)
    mask: Tensor  # (B, T) response tokens of the samples that train
    values: Tensor | None  # (B, T) the critic's estimates (gae only), else None
    group_size: int  # samples per prompt
    valid: Tensor  # (B,) bool: the samples that count; the others leave their group


def gae_estimator(x: EstimatorInput, gamma: float, lam: float, whiten_rewards: bool) -> tuple[Tensor, Tensor]:
    """PPO's: token rewards (the KL per token if in the reward), optionally rescaled, then GAE."""
    rewards = token_rewards(x.scores, x.kl, x.kl_coef if x.kl_in_reward else 0.0, x.mask)
    if whiten_rewards:
        rewards = masked_whiten(rewards, x.mask, shift_mean=False)
    return compute_gae(rewards, x.values, x.mask, gamma, lam)


def reinforce_pp_estimator(x: EstimatorInput, gamma: float, group_baseline: bool) -> tuple[Tensor, None]:
    """REINFORCE++'s discounted token returns (reinforce_pp_returns); no value targets."""
    kl_coef = x.kl_coef if x.kl_in_reward else 0.0
    return reinforce_pp_returns(x.scores, x.kl, kl_coef, x.mask, gamma, x.group_size, x.valid, group_baseline), None


def sequence_scores(x: EstimatorInput) -> Tensor:
    """(B,) the scores an outcome estimator compares: minus kl_coef * each sequence's KL if in the reward."""
    return x.scores - x.kl_coef * masked_sum(x.kl, x.mask, dim=-1) if x.kl_in_reward else x.scores


def grpo_estimator(x: EstimatorInput, scale_by_std: bool) -> tuple[Tensor, None]:
    """grpo_advantages on the sequence scores, the same for every token of a response."""
    return grpo_advantages(sequence_scores(x), x.group_size, x.valid, scale_by_std=scale_by_std)[:, None] * x.mask, None


def rloo_estimator(x: EstimatorInput) -> tuple[Tensor, None]:
    """rloo_advantages on the sequence scores, the same for every token of a response."""
    return rloo_advantages(sequence_scores(x), x.group_size, x.valid)[:, None] * x.mask, None


def reinforce_baseline_estimator(x: EstimatorInput, baseline: str) -> tuple[Tensor, None]:
    """reinforce_baseline_advantages on the sequence scores, the same for every token of a response."""
    adv = reinforce_baseline_advantages(sequence_scores(x), x.group_size, x.valid, baseline=baseline)
    return adv[:, None] * x.mask, None


# algorithm.estimator -> its function: (EstimatorInput, **its options) -> (advantages, returns or None)
ESTIMATORS = {
    "gae": gae_estimator,
    "grpo": grpo_estimator,
    "rloo": rloo_estimator,
    "reinforce_baseline": reinforce_baseline_estimator,
    "reinforce_pp": reinforce_pp_estimator,
}


# ---------------------------------------------------------------- losses


def aggregate(
    loss: Tensor, mask: Tensor, mode: str = "token_mean", total: float | None = None, norm_tokens: float | None = None
) -> Tensor:
    """token_mean: every response token weighs the same; seq_mean: per-sequence mean, then mean;
    seq_sum_norm (Dr. GRPO): per-sequence sum / norm_tokens, then mean, so no length bias.

    `total` replaces the denominator (tokens for token_mean, sequences otherwise) with that of
    the whole mini-batch, so micro-batch losses on any number of ranks add up to the global one.
    """
    if mode == "token_mean":
        return masked_mean(loss, mask) if total is None else masked_sum(torch.where(mask > 0, loss, 0.0), mask) / total
    if mode not in ("seq_mean", "seq_sum_norm"):
        raise ValueError(f"unknown loss aggregation {mode!r}; expected token_mean, seq_mean or seq_sum_norm")
    if mode == "seq_sum_norm" and not norm_tokens:
        raise ValueError("seq_sum_norm needs norm_tokens > 0")
    has_token = (mask.sum(-1) > 0).float()
    per_seq = (
        masked_mean(loss, mask, dim=-1)
        if mode == "seq_mean"
        else masked_sum(torch.where(mask > 0, loss, 0.0), mask, dim=-1) / norm_tokens
    )
    return masked_mean(per_seq, has_token) if total is None else masked_sum(per_seq, has_token) / total


def aggregate_total(mask: Tensor, mode: str) -> float:
    """The denominator `aggregate` uses for this mask: response tokens, or sequences with any."""
    return float(mask.sum()) if mode == "token_mean" else float((mask.sum(-1) > 0).sum())


@dataclass
class PolicyLossInput:
    """What every policy loss takes (one signature for the family: (PolicyLossInput, clip_eps, clip_eps_high)
    -> (loss, metrics with clip_frac, approx_kl and ratio_mean)), and how it aggregates (`aggregate`)."""

    logprobs: Tensor  # (B, T) the policy's, with gradient
    old_logprobs: Tensor  # (B, T) the proximal policy's
    advantages: Tensor  # (B, T); broadcast an outcome advantage with `adv[:, None] * mask`
    mask: Tensor  # (B, T)
    aggregation: str = "token_mean"  # aggregate's mode
    total: float | None = None  # aggregate's denominator for the whole mini-batch
    weights: Tensor | None = None  # (B, T), detached: multiply each token's term (off-policy correction)
    norm_tokens: float | None = None  # seq_sum_norm's constant


def ppo_policy_loss(
    x: PolicyLossInput, clip_eps: float, clip_eps_high: float | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate (Schulman et al. 2017), negated to be minimised.

    clip_eps_high (DAPO's clip-higher) defaults to clip_eps. `x.weights` (B, T), detached, multiply
    each token's term (off-policy correction, `off_policy.off_policy_weights`); a zero weight keeps the token in
    the denominator, as AReaL and IcePop do, so masking tokens does not rescale the others.
    """
    log_ratio = torch.where(x.mask > 0, x.logprobs.float() - x.old_logprobs.float(), 0.0)
    return clipped_surrogate(log_ratio.exp(), log_ratio, x, clip_eps, clip_eps_high)


def clipped_surrogate(
    ratio: Tensor, log_ratio: Tensor, x: PolicyLossInput, clip_eps: float, clip_eps_high: float | None
) -> tuple[Tensor, dict[str, Tensor]]:
    """-min(ratio * A, clip(ratio) * A) per token (B, T), aggregated: PPO's on token ratios, GSPO's on
    sequence ratios; the metrics' approx_kl comes from the token `log_ratio`."""
    high = clip_eps if clip_eps_high is None else clip_eps_high
    unclipped = -x.advantages * ratio
    clipped = -x.advantages * ratio.clamp(1.0 - clip_eps, 1.0 + high)
    per_token = torch.maximum(unclipped, clipped)
    weighted = per_token if x.weights is None else per_token * x.weights
    loss = aggregate(weighted, x.mask, x.aggregation, x.total, x.norm_tokens)
    return loss, ratio_metrics(log_ratio, ratio, clipped > unclipped, x.mask)


@torch.no_grad()
def ratio_metrics(log_ratio: Tensor, ratio: Tensor, clipped: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """What every policy loss reports, over response tokens: the fraction `clipped`, the k3 estimate
    of KL(old || new) from the token log-ratios, and the mean of the ratio the loss used."""
    return {
        "clip_frac": masked_mean(clipped.float(), mask),
        "approx_kl": masked_mean(log_ratio.exp() - 1.0 - log_ratio, mask),
        "ratio_mean": masked_mean(ratio, mask),
    }


def ppo_value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip_eps: float | None,
    aggregation: str = "token_mean",
    total: float | None = None,
    norm_tokens: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Half squared error to the returns; with clip_eps, the pessimistic max of the plain and the
    clipped-around-old-values error (PPO2's value clipping)."""
    # where() first: garbage on padding (inf, nan) would reach the gradient as 0 * inf = nan
    values, returns = (torch.where(mask > 0, x.float(), 0.0) for x in (values, returns))
    err = (values - returns) ** 2
    if clip_eps is None:
        loss_tok, clip_frac = err, torch.zeros((), device=values.device)
    else:
        old_values = torch.where(mask > 0, old_values.float(), 0.0)
        clipped = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
        err_clipped = (clipped - returns) ** 2
        loss_tok = torch.maximum(err, err_clipped)
        clip_frac = masked_mean((err_clipped > err).float(), mask)
    return 0.5 * aggregate(loss_tok, mask, aggregation, total, norm_tokens), {"vf_clip_frac": clip_frac.detach()}


# ----------------------------------------------------------------------------- SFT and reward models
def sft_loss_sum(logits: Tensor, input_ids: Tensor, loss_mask: Tensor) -> Tensor:
    """Summed next-token negative log-likelihood over the masked (response) targets.
    logits (B, T, V) for input_ids (B, T); loss_mask (B, T-1) marks targets input_ids[:, 1:]."""
    return -masked_sum(logprobs_from_logits(logits[:, :-1], input_ids[:, 1:]), loss_mask)


def bradley_terry_loss(chosen: Tensor, rejected: Tensor, margin: float = 0.0) -> Tensor:
    """Per-pair reward-model loss -log sigmoid(r_chosen - r_rejected - margin) (Ouyang et al. 2022;
    the margin as in Llama 2)."""
    return -torch.nn.functional.logsigmoid(chosen - rejected - margin)

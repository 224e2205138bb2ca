"""Off-policy corrections: the weights that carry PPO's estimate from the behaviour policy mu (the engine
that sampled) to the proximal policy pi_prox, per token, per sequence or by geometric mean; TIS, IcePop and
decoupled PPO (one `OFF_POLICY_CORRECTIONS` dict), and the ratio statistics a user watches.

Pure functions on tensors with learner/algorithms.py's conventions (shapes B = samples, T = response tokens,
`mask` (B, T)); imports torch and nothing distributed, no model and no config (tests/unit/test_architecture.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from learner.algorithms import masked_mean, masked_sum

# The samples come from a behaviour policy mu: the engine that sampled them, some policy versions
# behind in asynchronous training and numerically apart from the learner always (another kernel,
# another dtype). PPO's ratio is taken to the proximal policy pi_prox, the learner's weights at the
# start of the update (the old logprobs, which relay always recomputes); these weights carry the
# estimate from mu to pi_prox. Each correction: (ratio pi_prox/mu (B, T), mask, cap, low, high) ->
# (weights (B, T), 1.0 where the correction cut the ratio).


def behaviour_ratio(prox_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, level: str = "token") -> Tensor:
    """pi_prox/mu per token (level "token"), or per sequence broadcast over its tokens: the product of
    its token ratios ("sequence") or their geometric mean ("geometric"), over the tokens inside the
    learner's filter only (filter_inside). 1 on padding and outside tokens; log-ratios are clamped to
    +-20 so a sequence product cannot overflow."""
    inside = filter_inside(prox_logprobs, mask)
    log_ratio = torch.where(inside > 0, prox_logprobs.float() - behaviour_logprobs.float(), 0.0)
    if level == "sequence":
        log_ratio = masked_sum(log_ratio, inside, dim=-1)[:, None].expand_as(log_ratio)
    elif level == "geometric":
        log_ratio = masked_mean(log_ratio, inside, dim=-1)[:, None].expand_as(log_ratio)
    elif level != "token":
        raise ValueError(f"unknown off-policy level {level!r}; expected token, sequence or geometric")
    return torch.where(inside > 0, log_ratio.clamp(-20.0, 20.0).exp(), 1.0)


def filter_inside(prox_logprobs: Tensor, mask: Tensor) -> Tensor:
    """`mask` without the tokens whose pi_prox logprob is not finite: kept by the sampler, outside the
    learner's top-k/top-p filter (a near-tie, another dtype). Weight 0 and counted cut, not a silent e^-20."""
    return mask * torch.isfinite(prox_logprobs)


def truncated_is(ratio: Tensor, mask: Tensor, cap: float, low: float, high: float) -> tuple[Tensor, Tensor]:
    """TIS (Yao et al. 2025): the ratio, truncated at `cap`."""
    return ratio.clamp(max=cap), ((ratio > cap) & (mask > 0)).float()


def icepop(ratio: Tensor, mask: Tensor, cap: float, low: float, high: float) -> tuple[Tensor, Tensor]:
    """IcePop (Ling team, Ring-1T 2025): the ratio where it lies in [low, high], 0 outside: tokens (or
    whole sequences, with a sequence level) the two policies disagree on too much teach nothing."""
    outside = ((ratio < low) | (ratio > high)) & (mask > 0)
    return torch.where(outside, 0.0, ratio), outside.float()


def decoupled(ratio: Tensor, mask: Tensor, cap: float, low: float, high: float) -> tuple[Tensor, Tensor]:
    """Decoupled PPO (Hilton et al. 2021; AReaL, Fu et al. 2025): the ratio as it is, with the tokens
    above `cap` masked out rather than truncated."""
    over = (ratio > cap) & (mask > 0)
    return torch.where(over, 0.0, ratio), over.float()


OFF_POLICY_CORRECTIONS = {"tis": truncated_is, "icepop": icepop, "decoupled": decoupled}


def off_policy_weights(
    prox_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    mask: Tensor,
    kind: str,
    level: str = "token",
    cap: float = 2.0,
    low: float = 0.5,
    high: float = 2.0,
) -> Tensor | None:
    """The detached per-token weights of `kind` (a key of OFF_POLICY_CORRECTIONS), 0 on padding,
    for ppo_policy_loss; None for "none" (plain PPO on the proximal ratio)."""
    if kind == "none":
        return None
    ratio = behaviour_ratio(prox_logprobs.detach(), behaviour_logprobs, mask, level)
    weights, _ = OFF_POLICY_CORRECTIONS[kind](ratio, mask, cap, low, high)
    return torch.where(filter_inside(prox_logprobs.detach(), mask) > 0, weights, 0.0)


def ratio_stats(
    prox_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    mask: Tensor,
    kind: str,
    level: str = "token",
    cap: float = 2.0,
    low: float = 0.5,
    high: float = 2.0,
) -> dict[str, float]:
    """What a user watches of pi_prox/mu at `level`: its mean and max over the tokens inside the
    learner's filter, and the fraction of tokens `kind` truncated or masked (0 for "none"), the
    tokens outside the filter included (they get weight 0)."""
    ratio = behaviour_ratio(prox_logprobs, behaviour_logprobs, mask, level)
    inside = filter_inside(prox_logprobs, mask)
    cut = torch.zeros_like(mask)
    if kind != "none":  # outside the filter: weight 0, so cut
        cut = OFF_POLICY_CORRECTIONS[kind](ratio, inside, cap, low, high)[1] + (mask > 0).float() - (inside > 0).float()
    has = inside > 0
    return {
        "ratio_mean": float(masked_mean(ratio, inside)),
        "ratio_max": float(ratio[has].max()) if has.any() else 1.0,
        "clipped_frac": float(masked_mean(cut, mask)),
    }

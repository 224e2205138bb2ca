"""A micro-batch's loss, assembled from the policy's logits: the policy loss of algorithm.policy_loss
(learner/losses.py's table) with its off-policy weights, the entropy bonus and the KL when placed in the
loss (`policy_loss`, read as `LossSettings` says), and the micro-batch's metrics (`micro_metrics`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from learner import algorithms as A
from learner import losses as L
from learner.config import AlgorithmConfig, KLPlacement, PolicyLoss
from learner.engine import TOKENS
from learner.experience import MicroBatch
from learner.off_policy import off_policy_weights
from runtime.logprobs import SamplerSettings, chunked_logprobs_entropy, filtered_logprobs, map_chunks


@dataclass
class LossSettings:
    """How policy_loss reads a micro-batch, beside the algorithm config: the sampler's distribution
    (temperature, top-k/top-p filter), the logprob chunking, and the aggregation over the mini-batch."""

    temperature: float  # the sampler's: logprobs are of logits / temperature
    chunk_tokens: int  # tokens whose logits are upcast to float32 at once
    total: float  # aggregate's denominator for the whole mini-batch
    aggregation: str  # algorithm.loss_aggregation
    norm_tokens: float | None = None  # seq_sum_norm's constant (loss_norm_tokens)
    top_k: int = -1  # the sampler's filter, under which pi_prox meets mu (terms["sampler_logprobs"])
    top_p: float = 1.0
    old_from_forward: bool = False  # experience.single_pass: the old logprobs are this forward's, detached


def policy_loss(
    logits: torch.Tensor, mb: MicroBatch, algo: AlgorithmConfig, kl_coef: float, how: LossSettings
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A micro-batch's loss from its logits (B, L-1, V) (the policy loss is algorithm.policy_loss's, from
    learner/losses.py's table), and its terms (policy, entropy, clip_frac, approx_kl, kl when placed in
    the loss, and the detached logprobs). Logprobs and entropy come chunk by chunk (no float32
    (B, L-1, V) tensor); the entropy enters the graph only when entropy_coef uses it.
    how.old_from_forward (experience.single_pass): the old logprobs are these logprobs, detached, instead
    of mb.old_logprobs. *_token terms: per-token means (metrics), whatever the aggregation."""
    mask, use_entropy = mb.mask, algo.entropy_coef != 0
    agg, total, norm_tokens = how.aggregation, how.total, how.norm_tokens
    logprobs, entropy = chunked_logprobs_entropy(
        logits, mb.input_ids[:, 1:], how.temperature, how.chunk_tokens, entropy_grad=use_entropy
    )
    old = logprobs.detach() if how.old_from_forward else mb.old_logprobs  # the proximal policy's
    sampled, weights = off_policy_terms(logits, mb, algo, how, old)
    # cispo's lower bound has its own key: the paper has none, and PPO's clip_eps would impose one
    low = (algo.cispo.clip_low or None) if algo.policy_loss == PolicyLoss.cispo else algo.clip_eps
    pg, pm = L.POLICY_LOSSES[algo.policy_loss.value](
        A.PolicyLossInput(logprobs, old, mb.advantages, mask, agg, total, weights, norm_tokens),
        low,
        algo.clip_eps_high or algo.clip_eps,
    )
    ent_token, entropy = entropy, A.aggregate(entropy, mask, agg, total, norm_tokens)
    loss = pg - algo.entropy_coef * entropy if use_entropy else pg
    terms = {
        "policy": pg,
        "entropy": entropy,
        "entropy_token": A.masked_mean(ent_token.detach(), mask),
        "clip_frac": pm["clip_frac"],
        "approx_kl": pm["approx_kl"],
        "logprobs": logprobs.detach(),
        "sampler_logprobs": sampled,
    }
    if algo.kl_placement == KLPlacement.loss:
        kl = A.kl_penalty(logprobs, mb.ref_logprobs, algo.kl_estimator.value, mask)
        terms["kl"] = A.aggregate(kl, mask, agg, total, norm_tokens)
        terms["kl_token"] = A.masked_mean(kl.detach(), mask)
        loss = loss + kl_coef * terms["kl"]
    return loss, terms


def off_policy_terms(
    logits: torch.Tensor, mb: MicroBatch, algo: AlgorithmConfig, how: LossSettings, old: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(pi_prox's logprobs under the sampler's filter, or None where nothing reads them; the off-policy
    correction's weights, or None without one). pi_prox as the sampler saw it: mu (the engine's processed
    logprobs) is renormalised inside the filter, so an unfiltered pi_prox would put the ratio below 1 in
    sync mode."""
    o, mask = algo.off_policy, mb.mask
    corrected = o.kind != "none"
    sampled = mb.sampler_logprobs if not how.old_from_forward and corrected else None
    if how.old_from_forward:
        sampled = (
            map_chunks(
                lambda x, y: filtered_logprobs(x, y, how.top_k, how.top_p),
                logits.detach(),
                mb.input_ids[:, 1:],
                how.temperature,
                how.chunk_tokens,
            )
            if how.top_k > 0 or how.top_p < 1.0
            else old
        )
    weights = (
        off_policy_weights(sampled, mb.behaviour_logprobs, mask, o.kind, o.level.value, o.cap, o.low, o.high)
        if corrected
        else None
    )
    return sampled, weights


def micro_metrics(terms: dict[str, torch.Tensor], mask: torch.Tensor) -> dict[str, float]:
    """A micro-batch's metrics for engine.update_metrics: its loss, and its per-token means times its
    response tokens (summed, then divided by the update's tokens: one unit in every aggregation)."""
    tokens = float(mask.sum())
    m = {"loss/policy": terms["policy"].item(), TOKENS: tokens}
    names = {
        "learner/entropy": "entropy_token",
        "learner/clip_frac": "clip_frac",
        "learner/approx_kl": "approx_kl",
        "loss/kl": "kl_token",
    }
    m.update({k: terms[t].item() * tokens for k, t in names.items() if t in terms})
    return m


def loss_norm_tokens(algo: AlgorithmConfig, sampling: SamplerSettings) -> int:
    """seq_sum_norm's constant (Dr. GRPO): algorithm.loss_norm_tokens (the trainer sets 0 to the sample's
    whole budget, orchestrator.loop.roles.learner_algorithm), else one response's max_new_tokens."""
    return algo.loss_norm_tokens or sampling.max_new_tokens

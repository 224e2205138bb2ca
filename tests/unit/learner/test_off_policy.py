"""Off-policy corrections (TIS, IcePop, decoupled PPO) against examples worked out by hand.

Two samples: the first has 3 tokens with pi_prox = (.5, .2, .3) and mu = (.25, .4, .3), so the token
ratios pi_prox/mu are (2, .5, 1); the second has 1 token, .9 against .3 (ratio 3), then padding whose
logprobs are garbage and must change nothing.
"""

import math

import pytest
import torch

from learner import algorithms as A
from learner import off_policy as OP
from runtime.logprobs import filtered_logprobs, logprobs_from_logits
from tests.helpers import close, make_micro_batch

t = torch.tensor
PROX = torch.log(t([[0.5, 0.2, 0.3], [0.9, 0.7, 0.1]]))
MU = torch.log(t([[0.25, 0.4, 0.3], [0.3, 1e-9, 0.9]]))
MASK = t([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])


def test_ratio_per_token_per_sequence_and_geometric():
    assert close(OP.behaviour_ratio(PROX, MU, MASK, "token"), t([[2.0, 0.5, 1.0], [3.0, 1.0, 1.0]]))
    # sequence: 2 * .5 * 1 = 1 for the first, 3 for the second, on every one of their tokens
    assert close(OP.behaviour_ratio(PROX, MU, MASK, "sequence"), t([[1.0, 1.0, 1.0], [3.0, 1.0, 1.0]]))
    # geometric: exp(mean(log 2, log .5, 0)) = 1, and 3 for a one-token sequence
    assert close(OP.behaviour_ratio(PROX, MU, MASK, "geometric"), t([[1.0, 1.0, 1.0], [3.0, 1.0, 1.0]]))
    geo = OP.behaviour_ratio(PROX[:1, :2], MU[:1, :2], MASK[:1, :2], "geometric")  # sqrt(2 * .5) = 1
    seq = OP.behaviour_ratio(PROX[:1, :1], MU[:1, :1], MASK[:1, :1], "sequence")
    assert close(geo, t([[1.0, 1.0]])) and close(seq, t([[2.0]]))
    with pytest.raises(ValueError, match="unknown off-policy level"):
        OP.behaviour_ratio(PROX, MU, MASK, "per_word")


def test_a_sequence_product_cannot_overflow():
    far = OP.behaviour_ratio(t([[0.0] * 50]), t([[-5.0] * 50]), torch.ones(1, 50), "sequence")  # e^250 uncapped
    assert torch.isfinite(far).all() and close(far, torch.full((1, 50), math.exp(20.0)), tol=1e3)


def test_truncated_importance_sampling_caps_the_ratio():
    w = OP.off_policy_weights(PROX, MU, MASK, "tis", "token", cap=1.5)
    assert close(w, t([[1.5, 0.5, 1.0], [1.5, 0.0, 0.0]]))  # padding 0
    stats = OP.ratio_stats(PROX, MU, MASK, "tis", "token", cap=1.5)
    assert close(stats["ratio_mean"], (2 + 0.5 + 1 + 3) / 4) and close(stats["ratio_max"], 3.0)
    assert close(stats["clipped_frac"], 2 / 4)  # 2 and 3 were cut


def test_icepop_masks_ratios_outside_the_band_and_keeps_the_rest_as_weights():
    # band [.45, 2.05]: 2, .5 and 1 stay; 3 is masked (bounds off the ratios: .5 computes as .49999997)
    assert close(
        OP.off_policy_weights(PROX, MU, MASK, "icepop", low=0.45, high=2.05), t([[2.0, 0.5, 1.0], [0.0, 0.0, 0.0]])
    )
    assert close(
        OP.off_policy_weights(PROX, MU, MASK, "icepop", low=0.6, high=2.05), t([[2.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    )
    # at the sequence level the first sample (product 1) keeps all its tokens at weight 1
    assert close(
        OP.off_policy_weights(PROX, MU, MASK, "icepop", "sequence", low=0.6, high=2.05),
        t([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]),
    )
    assert close(OP.ratio_stats(PROX, MU, MASK, "icepop", low=0.6, high=2.05)["clipped_frac"], 2 / 4)


def test_decoupled_ppo_masks_tokens_above_the_cap_rather_than_truncating():
    assert close(OP.off_policy_weights(PROX, MU, MASK, "decoupled", cap=2.0), t([[2.0, 0.5, 1.0], [0.0, 0.0, 0.0]]))
    assert close(OP.ratio_stats(PROX, MU, MASK, "decoupled", cap=2.0)["clipped_frac"], 1 / 4)


def test_none_gives_no_weights_and_unit_weights_change_nothing():
    assert OP.off_policy_weights(PROX, MU, MASK, "none") is None
    assert OP.ratio_stats(PROX, MU, MASK, "none")["clipped_frac"] == 0.0
    lp, adv = PROX + 0.1, t([[1.0, -2.0, 0.5], [1.0, 0.0, 0.0]])
    plain, _ = A.ppo_policy_loss(A.PolicyLossInput(lp, PROX, adv * MASK, MASK), 0.2)
    ones, _ = A.ppo_policy_loss(A.PolicyLossInput(lp, PROX, adv * MASK, MASK, weights=torch.ones_like(MASK)), 0.2)
    assert torch.equal(plain, ones)


def test_the_decoupled_objective_weights_each_tokens_clipped_term_hand_example():
    """Loss -sum_t w_t * min(r_t A_t, clip(r_t) A_t) / 4 tokens, r = pi_theta/pi_prox, w = pi_prox/mu
    masked above the cap. With pi_theta = pi_prox (r = 1, inside the clip) the loss is
    -(2 * 1 + .5 * (-2) + 1 * .5 + 0 * 1) / 4 = -.375 and d loss / d logprob_t = -w_t A_t / 4."""
    adv = t([[1.0, -2.0, 0.5], [1.0, 0.0, 0.0]]) * MASK
    w = OP.off_policy_weights(PROX, MU, MASK, "decoupled", cap=2.0)
    lp = PROX.clone().requires_grad_(True)
    loss, m = A.ppo_policy_loss(A.PolicyLossInput(lp, PROX, adv, MASK, weights=w), 0.2)
    assert close(loss, -0.375)
    loss.backward()
    assert close(lp.grad, t([[-0.5, 0.25, -0.125], [0.0, 0.0, 0.0]]))
    # outside the clip the weight multiplies the clipped (constant) term: r = 1.5 on token 1 with A > 0
    # -> -2 * 1.2 * 1 / 4 = -.6 from it, and no gradient through it
    lp2 = PROX.clone()
    lp2[0, 0] += math.log(1.5)
    lp2.requires_grad_(True)
    loss2, _ = A.ppo_policy_loss(A.PolicyLossInput(lp2, PROX, adv, MASK, weights=w), 0.2)
    assert close(loss2, -(2 * 1.2 + 0.5 * (-2) + 0.5) / 4)
    loss2.backward()
    assert close(lp2.grad[0, 0], 0.0)


def test_the_correction_compares_the_proximal_and_behaviour_policies_under_the_same_top_k_filter():
    """In sync mode the sampler's logprobs are the learner's own renormalised inside top-k (vLLM's
    processed logprobs): the ratio must be 1 and IcePop must keep every token. Unfiltered, the
    ratio would be the kept mass, 2/8-ish here, and IcePop (low .5) would mask every token."""
    from learner.config import AlgorithmConfig, KLPlacement, OffPolicyConfig, OffPolicyKind
    from learner.micro_batch_loss import LossSettings, policy_loss

    logits = t([[[0.3, 0.2, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0]] * 3])  # (1, 3, 8); the 2 kept tokens hold ~.28
    ids = t([[5, 0, 1, 0]])  # labels 0, 1, 0: inside the top-2
    mask, adv = torch.ones(1, 3), t([[1.0, -0.5, 2.0]])
    filtered = filtered_logprobs(logits, ids[:, 1:], top_k=2)
    assert float(logprobs_from_logits(logits, ids[:, 1:]).exp().max()) < 0.5 * float(filtered.exp().min())
    plain = AlgorithmConfig(kl_placement=KLPlacement.reward)
    ice = AlgorithmConfig(
        kl_placement=KLPlacement.reward, off_policy=OffPolicyConfig(correction=OffPolicyKind.icepop, low=0.5, high=2.0)
    )
    mb = make_micro_batch(ids, mask, advantages=adv, behaviour_logprobs=filtered.clone())
    want, _ = policy_loss(
        logits, mb, plain, 0.0, LossSettings(1.0, 16, 3.0, "token_mean", old_from_forward=True, top_k=2)
    )
    # single pass: pi_prox (and its filtered view) come from this forward
    got, terms = policy_loss(
        logits, mb, ice, 0.0, LossSettings(1.0, 16, 3.0, "token_mean", old_from_forward=True, top_k=2)
    )
    assert close(got, want) and close(terms["sampler_logprobs"], filtered)
    # recompute path: the experience's sampler_logprobs (the learner's under the filter) are used
    mb.old_logprobs, mb.sampler_logprobs = logprobs_from_logits(logits, ids[:, 1:]), filtered
    got, _ = policy_loss(logits, mb, ice, 0.0, LossSettings(1.0, 16, 3.0, "token_mean", top_k=2))
    assert close(got, want) and float(want) != 0.0
    ratio = OP.ratio_stats(mb.sampler_logprobs, mb.behaviour_logprobs, mask, "icepop", low=0.5, high=2.0)
    assert close(ratio["ratio_mean"], 1.0) and ratio["clipped_frac"] == 0.0

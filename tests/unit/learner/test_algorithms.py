"""The math core against small examples computed by hand (worked out in the comments)."""

import math

import pytest
import torch

from learner import algorithms as A
from runtime.logprobs import entropy_from_logits, filtered_logprobs, logprobs_from_logits
from tests.helpers import close

t = torch.tensor


# ---------------------------------------------------------------- masked statistics


def test_masked_mean_ignores_padding_even_when_it_is_nan():
    x = t([[1.0, 2.0, float("nan")], [3.0, float("inf"), 5.0]])
    mask = t([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    assert close(A.masked_mean(x, mask), (1 + 2 + 3 + 5) / 4)
    assert close(A.masked_mean(x, mask, dim=-1), [1.5, 4.0])


def test_masked_whiten_hand_example():
    # mean 2, unbiased var ((1)^2 + 0 + 1^2) / 2 = 1 -> [-1, 0, 1]; padding comes out 0
    x, mask = t([1.0, 2.0, 3.0, 100.0]), t([1.0, 1.0, 1.0, 0.0])
    assert close(A.masked_whiten(x, mask), [-1.0, 0.0, 1.0, 0.0])
    # shift_mean=False keeps the mean: [1, 2, 3]
    assert close(A.masked_whiten(x, mask, shift_mean=False), [1.0, 2.0, 3.0, 0.0])


def test_explained_variance():
    ret, mask = t([[1.0, 2.0, 3.0]]), t([[1.0, 1.0, 1.0]])
    assert close(A.explained_variance(ret, ret, mask), 1.0)
    # values = mean of returns: no better than a constant -> 0
    assert close(A.explained_variance(t([[2.0, 2.0, 2.0]]), ret, mask), 0.0)


# ---------------------------------------------------------------- logprobs and entropy


def test_filtered_logprobs_renormalise_over_the_kept_tokens():
    logits = torch.log(t([[[0.5, 0.3, 0.2]]]))
    # top-p .7: .5 alone reaches .5 < .7, .5 + .3 = .8 >= .7 -> keep {0, 1}, renormalised to .625 / .375
    assert close(filtered_logprobs(logits, t([[1]]), top_p=0.7), [[math.log(0.375)]])
    assert filtered_logprobs(logits, t([[2]]), top_p=0.7).item() == float("-inf")
    # top-k 1 keeps the argmax only; no filter is the plain logprob
    assert close(filtered_logprobs(logits, t([[0]]), top_k=1), [[0.0]])
    assert close(filtered_logprobs(logits, t([[2]])), logprobs_from_logits(logits, t([[2]])))
    # top-k 2 then top-p .9 over the renormalised pair (.625, .375): both needed
    assert close(filtered_logprobs(logits, t([[1]]), top_k=2, top_p=0.9), [[math.log(0.375)]])


def test_masked_rescale_keeps_zero_at_zero():
    x, mask = t([[2.0, 0.0], [-2.0, 5.0]]), t([[1.0, 1.0], [1.0, 0.0]])
    # unmasked [2, 0, -2]: mean 0, unbiased var 4 -> std 2
    assert close(A.masked_rescale(x, mask), [[1.0, 0.0], [-1.0, 0.0]])


def test_logprobs_and_entropy_hand_example():
    # uniform over 4 symbols: log p = -log 4, entropy = log 4
    logits = torch.zeros(1, 2, 4)
    lp = logprobs_from_logits(logits, t([[0, 3]]))
    assert close(lp, [[-math.log(4), -math.log(4)]])
    assert close(entropy_from_logits(logits, t([[1.0, 0.0]])), [[math.log(4), 0.0]])
    # logits [log 1, log 3]: p = [1/4, 3/4]; H = -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.562335
    two = torch.log(t([[[1.0, 3.0]]]))
    assert close(logprobs_from_logits(two, t([[1]])), [[math.log(0.75)]])
    assert close(entropy_from_logits(two, t([[1.0]])), [[0.562335]])


# ---------------------------------------------------------------- KL


def test_kl_estimators_hand_example():
    # log_ratio = policy - ref = 1: k1 = 1, k2 = 1/2, k3 = e^-1 - 1 + 1 = 0.367879
    lp, ref = t([[-1.0]]), t([[-2.0]])
    assert close(A.kl_penalty(lp, ref, "k1"), [[1.0]])
    assert close(A.kl_penalty(lp, ref, "k2"), [[0.5]])
    assert close(A.kl_penalty(lp, ref, "k3"), [[math.exp(-1)]])
    # log_ratio = -0.5: k1 = -0.5 (may be negative), k3 = e^0.5 - 1 - 0.5 = 0.148721
    assert close(A.kl_penalty(t([-1.5]), t([-1.0]), "k1"), [-0.5])
    assert close(A.kl_penalty(t([-1.5]), t([-1.0]), "k3"), [0.148721])
    with pytest.raises(ValueError, match="k4"):
        A.kl_penalty(lp, ref, "k4")


def test_k3_is_nonnegative_and_finite_and_masked():
    g = torch.Generator().manual_seed(0)
    lp, ref = torch.randn(64, 16, generator=g) * 10, torch.randn(64, 16, generator=g) * 10
    kl = A.kl_penalty(lp, ref, "k3")
    assert (kl >= 0).all() and torch.isfinite(kl).all()
    mask = (torch.rand(64, 16, generator=g) > 0.5).float()
    assert (A.kl_penalty(lp, ref, "k3", mask)[mask == 0] == 0).all()


def test_token_rewards_hand_example():
    # row 0: -0.1*[0.1, 0.2, 0.3] with the score 1 on the last token -> [-0.01, -0.02, 0.97]
    # row 1: last response token is index 1 -> [-0.05, -0.05 + 2, 0]; row 2 has no tokens -> zeros
    kl = t([[0.1, 0.2, 0.3], [0.5, 0.5, 9.0], [1.0, 1.0, 1.0]])
    mask = t([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    r = A.token_rewards(t([1.0, 2.0, 3.0]), kl, 0.1, mask)
    assert close(r, [[-0.01, -0.02, 0.97], [-0.05, 1.95, 0.0], [0.0, 0.0, 0.0]])


def test_last_token_index_with_left_and_right_padding():
    mask = t([[0.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    assert A.last_token_index(mask).tolist() == [2, 0, 3]


# ---------------------------------------------------------------- GAE


def test_gae_hand_example():
    # gamma .9, lam .8, V = [.5, .4, .3], r = [0, 0, 1], V after the end = 0
    # t2: d = 1 - .3 = .7                 A2 = .7
    # t1: d = .9*.3 - .4 = -.13           A1 = -.13 + .72*.7 = .374
    # t0: d = .9*.4 - .5 = -.14           A0 = -.14 + .72*.374 = .12928
    adv, ret = A.compute_gae(t([[0.0, 0.0, 1.0]]), t([[0.5, 0.4, 0.3]]), torch.ones(1, 3), 0.9, 0.8)
    assert close(adv, [[0.12928, 0.374, 0.7]])
    assert close(ret, [[0.62928, 0.774, 1.0]])


def test_gae_lambda_one_gamma_one_is_reward_to_go_minus_value():
    g = torch.Generator().manual_seed(1)
    r, v = torch.randn(4, 7, generator=g), torch.randn(4, 7, generator=g)
    mask = torch.ones(4, 7)
    adv, ret = A.compute_gae(r, v, mask, 1.0, 1.0)
    to_go = r.flip(-1).cumsum(-1).flip(-1)
    assert close(adv, to_go - v)
    assert close(ret, to_go)
    assert close(A.discounted_returns(r, mask, 1.0), to_go)


def test_discounted_returns_hand_example():
    # gamma .5, r = [1, 2, 4]: [1 + .5*2 + .25*4, 2 + .5*4, 4] = [3, 4, 4]
    assert close(A.discounted_returns(t([[1.0, 2.0, 4.0]]), torch.ones(1, 3), 0.5), [[3.0, 4.0, 4.0]])


def test_gae_padding_never_changes_the_result():
    g = torch.Generator().manual_seed(2)
    r, v = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    adv, ret = A.compute_gae(r, v, torch.ones(3, 5), 0.97, 0.9)
    # the same tokens with 2 garbage columns on the left, 1 in a hole after token 2, 3 on the right
    pos = [2, 3, 5, 6, 7]
    big_r, big_v = torch.randn(3, 11, generator=g) * 100, torch.randn(3, 11, generator=g) * 100
    big_r[:, pos], big_v[:, pos] = r, v
    mask = torch.zeros(3, 11)
    mask[:, pos] = 1.0
    big_adv, big_ret = A.compute_gae(big_r, big_v, mask, 0.97, 0.9)
    assert close(big_adv[:, pos], adv) and close(big_ret[:, pos], ret)
    assert (big_adv[mask == 0] == 0).all() and (big_ret[mask == 0] == 0).all()


# ---------------------------------------------------------------- outcome estimators


def test_grpo_hand_example():
    # group [1, 0, 0, 1]: mean .5, unbiased std sqrt(1/3) = .57735 -> +-.5/.57735 = +-.866025
    # group [2, 2, 2, 2]: all equal -> 0
    adv = A.grpo_advantages(t([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0]), 4)
    assert close(adv, [0.866025, -0.866025, -0.866025, 0.866025, 0, 0, 0, 0])
    assert close(A.grpo_advantages(t([1.0, 0.0, 3.0, 1.0]), 2, scale_by_std=False), [0.5, -0.5, 1.0, -1.0])


def test_grpo_gives_equal_scores_exactly_zero_however_they_round():
    # eight 0.1s: float32's mean of them is off 0.1 by a rounding, which over (std + 1e-6) was -0.0074 each, one
    # advantage for the whole group; a reward normaliser makes such scores (eight 0 rewards, running: +0.056 each)
    for score in (0.1, -0.3377, 1 / 3):
        assert torch.equal(A.grpo_advantages(torch.full((8,), score), 8), torch.zeros(8))
        assert torch.equal(A.grpo_advantages(torch.full((8,), score), 8, scale_by_std=False), torch.zeros(8))
    # equal among the valid ones: the dropped 0.7 leaves the group; a group with a spread keeps its advantages:
    # [.1, .2, .1, .2]: +-.05 over (unbiased std .057735 + 1e-6) = +-.866010
    valid = t([True, True, False, True, True, True, True, True])
    adv = A.grpo_advantages(t([0.1, 0.1, 0.7, 0.1, 0.1, 0.2, 0.1, 0.2]), 4, valid)
    assert torch.equal(adv[:4], torch.zeros(4)) and close(adv[4:], [-0.866010, 0.866010, -0.866010, 0.866010])
    # a non-finite score is not equal scores: the group stays non-finite, for the learner to count and skip
    for bad in ([1.0, 0.0, float("nan"), 1.0], [1.0] * 3 + [float("inf")], [float("inf")] * 4, [float("nan")] * 4):
        assert not A.grpo_advantages(t(bad), 4).isfinite().any(), bad


def test_grpo_groups_sum_to_zero():
    scores = torch.randn(6 * 5, generator=torch.Generator().manual_seed(3))
    assert close(A.grpo_advantages(scores, 5).view(6, 5).sum(-1), torch.zeros(6), tol=1e-4)
    with pytest.raises(ValueError, match="groups of 4"):
        A.grpo_advantages(torch.zeros(6), 4)


def test_rloo_hand_example():
    # [1, 0, 0, 1]: for a 1 the others average 1/3 -> 2/3; for a 0 they average 2/3 -> -2/3
    assert close(A.rloo_advantages(t([1.0, 0.0, 0.0, 1.0]), 4), [2 / 3, -2 / 3, -2 / 3, 2 / 3])
    # [3, 1]: 3 - 1 = 2, 1 - 3 = -2
    assert close(A.rloo_advantages(t([3.0, 1.0]), 2), [2.0, -2.0])
    with pytest.raises(ValueError):
        A.rloo_advantages(t([1.0]), 1)


def test_reinforce_baseline_hand_example():
    scores = t([1.0, 2.0, 3.0, 7.0])
    # batch baseline: mean 13/4 = 3.25
    assert close(A.reinforce_baseline_advantages(scores, 2, baseline="batch"), [-2.25, -1.25, -0.25, 3.75])
    # group baseline (REINFORCE++-baseline): groups [1, 2] (mean 1.5) and [3, 7] (mean 5)
    assert close(A.reinforce_baseline_advantages(scores, 2), [-0.5, 0.5, -2.0, 2.0])
    # one sample per prompt: the group baseline is the sample itself, so only the batch one learns
    assert close(A.reinforce_baseline_advantages(scores, 1), [0, 0, 0, 0])
    # a dropped sample leaves its group: [1, -, 3, 7] -> batch mean 11/3 over the valid three
    valid = t([True, False, True, True])
    assert close(A.reinforce_baseline_advantages(scores, 4, valid), [1 - 11 / 3, 0, 3 - 11 / 3, 7 - 11 / 3])
    with pytest.raises(ValueError, match="baseline"):
        A.reinforce_baseline_advantages(scores, 2, baseline="median")


def test_dropped_samples_leave_their_group():
    # group [1, 0, (dropped), 1] and group [5, (dropped), (dropped), (dropped)]
    scores = t([1.0, 0.0, 9.0, 1.0, 5.0, 9.0, 9.0, 9.0])
    valid = t([True, True, False, True, True, False, False, False])
    # GRPO on [1, 0, 1]: mean 2/3, centred [1/3, -2/3, 1/3], unbiased std sqrt((1/9 + 4/9 + 1/9) / 2) = .57735
    # -> [.57735, -1.1547, 0, .57735]; the second group has 1 valid sample: it contributes nothing
    assert close(A.grpo_advantages(scores, 4, valid), [0.57735, -1.154701, 0, 0.57735, 0, 0, 0, 0])
    # RLOO on [1, 0, 1]: a 1's others average .5 -> .5; the 0's others average 1 -> -1
    assert close(A.rloo_advantages(scores, 4, valid), [0.5, -1.0, 0, 0.5, 0, 0, 0, 0])
    # every sample valid gives the plain estimators
    everyone = torch.ones(8, dtype=torch.bool)
    assert close(A.grpo_advantages(scores, 4, everyone), A.grpo_advantages(scores, 4))
    assert close(A.rloo_advantages(scores, 4, everyone), A.rloo_advantages(scores, 4))


ESTIMATOR_OPTIONS = {
    "gae": {"gamma": 1.0, "lam": 1.0, "whiten_rewards": False},
    "grpo": {"scale_by_std": True},
    "rloo": {},
    "reinforce_baseline": {"baseline": "group"},
    "reinforce_pp": {"gamma": 1.0, "group_baseline": False},
}


def test_every_estimator_takes_one_input_and_returns_advantages_and_returns():
    mask = t([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    x = A.EstimatorInput(t([1.0, 0.0, 0.0, 1.0]), torch.zeros(4, 3), 0.1, True, mask, torch.zeros(4, 3), 2, None)
    assert set(A.ESTIMATORS) == set(ESTIMATOR_OPTIONS)
    for name, fn in A.ESTIMATORS.items():
        adv, returns = fn(x, **ESTIMATOR_OPTIONS[name])
        assert adv.shape == (4, 3) and (returns is None) == (name != "gae"), name
        assert not adv[mask == 0].any(), name  # padding gets nothing


def test_estimators_through_the_interface_match_their_hand_examples():
    mask = torch.ones(4, 1)
    x = A.EstimatorInput(t([1.0, 0.0, 0.0, 1.0]), torch.zeros(4, 1), 0.0, False, mask, None, 4, None)
    assert close(A.rloo_estimator(x)[0][:, 0], [2 / 3, -2 / 3, -2 / 3, 2 / 3])  # as rloo_advantages above
    scores = t([1.0, 2.0, 3.0, 7.0])
    x = A.EstimatorInput(scores, torch.zeros(4, 1), 0.0, False, mask, None, 2, None)
    assert close(A.reinforce_baseline_estimator(x, "batch")[0][:, 0], [-2.25, -1.25, -0.25, 3.75])
    # gamma .9, lam .8, V = [.5, .4, .3], r = [0, 0, 1]: the compute_gae hand example, the score on the last token
    gae = A.EstimatorInput(t([1.0]), torch.zeros(1, 3), 0.0, False, torch.ones(1, 3), t([[0.5, 0.4, 0.3]]), 1, None)
    adv, ret = A.gae_estimator(gae, 0.9, 0.8, False)
    assert close(adv, [[0.12928, 0.374, 0.7]]) and close(ret, [[0.62928, 0.774, 1.0]])


# ---------------------------------------------------------------- losses


def test_ppo_loss_with_ratio_one_is_minus_mean_advantage():
    adv = t([[1.0, -2.0, 4.0], [0.5, 0.5, 99.0]])
    mask = t([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    lp = torch.randn(2, 3)
    loss, m = A.ppo_policy_loss(A.PolicyLossInput(lp, lp.clone(), adv, mask), 0.2)
    assert close(loss, -(1 - 2 + 4 + 0.5 + 0.5) / 5)
    assert close(m["clip_frac"], 0.0) and close(m["approx_kl"], 0.0)


def test_ppo_loss_clipping_hand_example():
    # ratio 1.5 on both tokens. A=+1: unclipped -1.5, clipped -1.2, max -1.2 (clipped).
    # A=-1: unclipped 1.5, clipped 1.2, max 1.5 (not clipped). mean (-1.2 + 1.5)/2 = .15
    lp, old = torch.full((1, 2), math.log(1.5)), torch.zeros(1, 2)
    loss, m = A.ppo_policy_loss(A.PolicyLossInput(lp, old, t([[1.0, -1.0]]), torch.ones(1, 2)), 0.2)
    assert close(loss, 0.15) and close(m["clip_frac"], 0.5)
    # approx KL (k3 of old||new): 1.5 - 1 - ln 1.5 = 0.094535
    assert close(m["approx_kl"], 0.094535)
    # clip-higher 0.6: A=+1 is no longer clipped -> (-1.5 + 1.5)/2 = 0
    loss_hi, _ = A.ppo_policy_loss(
        A.PolicyLossInput(lp, old, t([[1.0, -1.0]]), torch.ones(1, 2)), 0.2, clip_eps_high=0.6
    )
    assert close(loss_hi, 0.0)


def test_ppo_loss_seq_mean_aggregation():
    # seq 0: tokens -1, -3 -> mean -2; seq 1: token -4 -> -4; seq_mean = -3, token_mean = -8/3
    lp = torch.zeros(2, 2)
    adv, mask = t([[1.0, 3.0], [4.0, 7.0]]), t([[1.0, 1.0], [1.0, 0.0]])
    assert close(A.ppo_policy_loss(A.PolicyLossInput(lp, lp, adv, mask, aggregation="seq_mean"), 0.2)[0], -3.0)
    assert close(A.ppo_policy_loss(A.PolicyLossInput(lp, lp, adv, mask), 0.2)[0], -8 / 3)


def test_ppo_policy_loss_padding_never_changes_the_result():
    g = torch.Generator().manual_seed(4)
    lp, old, adv = (torch.randn(2, 4, generator=g) for _ in range(3))
    mask = torch.ones(2, 4)
    loss, _ = A.ppo_policy_loss(A.PolicyLossInput(lp, old, adv, mask), 0.2)

    def pad(x, fill):
        return torch.cat([x, torch.full((2, 3), fill)], -1)

    loss_p, _ = A.ppo_policy_loss(A.PolicyLossInput(pad(lp, 1e6), pad(old, -1e6), pad(adv, 1e6), pad(mask, 0.0)), 0.2)
    assert close(loss, loss_p)


def test_value_loss_hand_example():
    # v = 1, old = 0, R = 2, eps .2: err 1, clipped value .2 -> err 3.24; max 3.24; half -> 1.62
    loss, m = A.ppo_value_loss(t([[1.0]]), t([[0.0]]), t([[2.0]]), t([[1.0]]), 0.2)
    assert close(loss, 1.62) and close(m["vf_clip_frac"], 1.0)
    loss, _ = A.ppo_value_loss(t([[1.0]]), t([[0.0]]), t([[2.0]]), t([[1.0]]), None)
    assert close(loss, 0.5)
    # padding: a masked token with a huge error changes nothing
    loss_p, _ = A.ppo_value_loss(t([[1.0, 50.0]]), t([[0.0, 0.0]]), t([[2.0, -50.0]]), t([[1.0, 0.0]]), 0.2)
    assert close(loss_p, 1.62)


# ---------------------------------------------------------------- KL per sequence


def test_sequence_kl_is_summed_over_tokens_and_averaged_over_samples():
    kl = t([[1.0, 2.0, 3.0, 99.0], [0.5, 0.5, 99.0, 99.0], [99.0, 99.0, 99.0, 99.0]])
    mask = t([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])  # the third row has no token
    assert close(A.sequence_kl(kl, mask), (6.0 + 1.0) / 2)
    assert close(A.masked_mean(kl, mask), 7.0 / 5)  # the per-token mean, a different unit


def test_micro_batch_losses_with_the_global_total_add_up_to_the_global_loss():
    g = torch.Generator().manual_seed(5)
    lp, old, adv = (torch.randn(6, 5, generator=g) for _ in range(3))
    mask = (torch.rand(6, 5, generator=g) > 0.3).float()
    mask[:, 0] = 1.0
    for mode in ("token_mean", "seq_mean", "seq_sum_norm"):  # norm_tokens is seq_sum_norm's (Dr. GRPO) only
        whole, _ = A.ppo_policy_loss(A.PolicyLossInput(lp, old, adv, mask, aggregation=mode, norm_tokens=5), 0.2)
        total = A.aggregate_total(mask, mode)
        parts = sum(
            A.ppo_policy_loss(
                A.PolicyLossInput(lp[s], old[s], adv[s], mask[s], aggregation=mode, total=total, norm_tokens=5), 0.2
            )[0]
            for s in (slice(0, 1), slice(1, 4), slice(4, 6))
        )
        assert close(parts, whole), mode
    # hand example: tokens [1, 2 | 3] -> token total 3: (1 + 2) / 3 + 3 / 3 = 2 = mean of all
    x, m = t([[1.0, 2.0], [3.0, 0.0]]), t([[1.0, 1.0], [1.0, 0.0]])
    assert A.aggregate_total(m, "token_mean") == 3.0 and A.aggregate_total(m, "seq_mean") == 2.0
    assert close(A.aggregate(x[:1], m[:1], "token_mean", 3.0) + A.aggregate(x[1:], m[1:], "token_mean", 3.0), 2.0)
    # seq_mean with 2 sequences: 1.5 / 2 + 3 / 2 = 2.25
    assert close(A.aggregate(x[:1], m[:1], "seq_mean", 2.0) + A.aggregate(x[1:], m[1:], "seq_mean", 2.0), 2.25)
    # seq_sum_norm, norm_tokens 4: sums 3 and 3 over 4, over 2 sequences: 0.375 + 0.375
    assert A.aggregate_total(m, "seq_sum_norm") == 2.0
    assert close(
        A.aggregate(x[:1], m[:1], "seq_sum_norm", 2.0, 4) + A.aggregate(x[1:], m[1:], "seq_sum_norm", 2.0, 4), 0.75
    )


def test_bradley_terry_hand_example():
    # r_c - r_r = 1: -log sigmoid(1) = log(1 + e^-1) = 0.31326; equal rewards: log 2 = 0.69315
    # margin 1 on a gap of 1 is like a gap of 0
    loss = A.bradley_terry_loss(t([1.0, 0.5, 2.0]), t([0.0, 0.5, 1.0]), margin=0.0)
    assert close(loss, t([0.31326, 0.69315, 0.31326]))
    assert close(A.bradley_terry_loss(t([2.0]), t([1.0]), margin=1.0), t([0.69315]))


def test_sft_loss_counts_only_the_masked_targets():
    # uniform logits over 4 tokens: each target costs log 4 = 1.38629; 2 of 3 targets are masked in
    logits = torch.zeros(1, 4, 4)
    ids = t([[0, 1, 2, 3]])
    assert close(A.sft_loss_sum(logits, ids, t([[0.0, 1.0, 1.0]])), t(2 * 1.38629))
    # making the masked-out (prompt) target likely changes nothing
    logits[0, 0, 1] = 10.0
    assert close(A.sft_loss_sum(logits, ids, t([[0.0, 1.0, 1.0]])), t(2 * 1.38629))

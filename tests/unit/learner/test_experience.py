"""Advantages as the learner builds them from a config (learner/experience.py): batch normalisation
per estimator, and samples dropped as invalid (reward.invalid: drop) leaving their groups."""

import math

import torch

from learner.config import (
    AlgorithmConfig,
    Baseline,
    Estimator,
    GRPOConfig,
    KLPlacement,
    ReinforceBaselineConfig,
    ReinforcePPConfig,
)
from learner.experience import advantages

t = torch.tensor


def outcome(cfg: AlgorithmConfig, scores, group_size, valid=None, lengths=None):
    """Per-sample advantage (first token) for responses of `lengths` tokens (default 1..B)."""
    B = len(scores)
    lengths = lengths or [1 + i % 3 for i in range(B)]
    mask = torch.zeros(B, 4)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1.0
    valid = torch.ones(B, dtype=torch.bool) if valid is None else t(valid)
    mask = mask * valid[:, None]
    adv, returns = advantages(cfg, t(scores), torch.zeros(B, 4), 0.0, mask, None, group_size, valid)
    assert returns is None and torch.all(adv[mask == 0] == 0)
    return adv[:, 0]


def test_an_all_equal_group_gets_exactly_zero_advantage_with_the_default_config():
    cfg = AlgorithmConfig()
    assert cfg.estimator == Estimator.grpo and cfg.normalize_advantages  # the defaults this is about
    adv = outcome(cfg, [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0], 4)
    assert torch.equal(adv[4:], torch.zeros(4))
    # and the informative group keeps GRPO's own scale (+-.866), not re-whitened over the batch
    assert torch.allclose(adv[:4], t([0.866025, -0.866025, -0.866025, 0.866025]), atol=1e-5)


def test_grouped_estimators_are_rescaled_not_shifted_by_batch_normalisation():
    scores = [1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0]
    for cfg in (AlgorithmConfig(estimator=Estimator.rloo), AlgorithmConfig(grpo=GRPOConfig(scale_by_std=False))):
        adv = outcome(cfg, scores, 4)
        assert torch.equal(adv[4:], torch.zeros(4)), cfg.estimator
        assert adv[0] > 0 > adv[1] and torch.allclose(adv[0], adv[3]), cfg.estimator


def test_reinforce_baseline_is_whitened_over_the_batch_like_its_peers():
    cfg = AlgorithmConfig(
        estimator=Estimator.reinforce_baseline, reinforce_baseline=ReinforceBaselineConfig(Baseline.batch)
    )
    adv = outcome(cfg, [1.0, 2.0, 3.0, 7.0], 1, lengths=[1, 1, 1, 1])
    assert abs(float(adv.mean())) < 1e-6 and abs(float(adv.std()) - 1) < 1e-4


def test_dropped_samples_leave_the_group_baseline():
    # group 0: [1, 0, dropped, 1]; group 1: [1, dropped, dropped, dropped] -> nothing to compare with
    valid = [True, True, False, True, True, False, False, False]
    adv = outcome(AlgorithmConfig(), [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0], 4, valid)
    assert torch.allclose(adv, t([0.57735, -1.154701, 0, 0.57735, 0, 0, 0, 0]), atol=1e-5)


def test_a_group_baseline_is_rescaled_never_shifted_so_an_all_equal_group_stays_zero():
    # group 0 centred: .5, -.5, -.5, .5 on 1, 2, 3, 1 tokens; group 1 (all 2.0) 0 on 2, 3, 1, 2 tokens.
    # Token mean (1 - 2.5) / 15 = -.1: whitening would give group 1 +.1 / std. Rescaling divides by the
    # unbiased token std sqrt((2 * .6^2 + 5 * .4^2 + 8 * .1^2) / 14) = sqrt(1.6 / 14) and shifts nothing.
    scores, std = [1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0], math.sqrt(1.6 / 14)
    want = t([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0]) / std
    cfg = AlgorithmConfig(
        estimator=Estimator.reinforce_baseline, reinforce_baseline=ReinforceBaselineConfig(Baseline.group)
    )
    adv = outcome(cfg, scores, 4)
    assert torch.equal(adv[4:], torch.zeros(4))
    assert torch.allclose(adv, want, atol=1e-5)


def test_reinforce_pp_baseline_subtracts_the_group_mean_then_whitens_over_the_batch_as_its_paper():
    """Hu 2025's REINFORCE++-baseline: r - group mean, then (x - batch mean) / batch std over every token.
    Same example: centred .5, -.5, -.5, .5 on 1, 2, 3, 1 tokens, group 1 0 on 2, 3, 1, 2; token mean -.1,
    unbiased token variance (2 * .6^2 + 5 * .4^2 + 8 * .1^2) / 14: group 1 gets +.1 / std, not 0."""
    scores, std = [1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0], math.sqrt(1.6 / 14)
    want = (t([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0]) + 0.1) / std
    adv = outcome(
        AlgorithmConfig(
            estimator=Estimator.reinforce_pp,
            reinforce_pp=ReinforcePPConfig(group_baseline=True),
            kl_placement=KLPlacement.loss,
        ),
        scores,
        4,
    )
    assert torch.allclose(adv, want, atol=1e-5)

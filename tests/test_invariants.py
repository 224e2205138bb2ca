"""Invariant sweeps (unit tier: no Ray, no model, small synthetic batches): the promises relay makes in
every combination of estimator x policy loss x loss aggregation x mask shape x seed, checked through
the functions the learner calls (learner.experience.advantages, learner.worker.policy_loss).

Mask shapes: "single_turn" (right padding of ragged responses, one invalid sample whose row is all 0)
and "episode" (the same, with observation tokens inside the responses masked out, as
RolloutBatch.action_mask makes them). Masked positions hold garbage (inf, nan, huge numbers).
"""
import itertools
import math

import pytest
import torch

from learner import algorithms as A
from learner import losses as L
from learner.config import AlgorithmConfig, Baseline, Estimator, KLPlacement, LossAggregation, PolicyLoss
from learner.experience import advantages
from learner.worker import _share, policy_loss
from reward_service.combine import SourceRun, combine
from rollout.seeds import request_seed

B, T, V, GROUP = 8, 7, 5, 4  # 2 groups of 4 samples; the second group is all equal where a test wants it
SEEDS = [0, 1, 2]
SHAPES = ["single_turn", "episode"]
AGGS = list(LossAggregation)
LOSSES = list(PolicyLoss)

# estimators whose advantage is centred on a group mean: an all-equal group gets exactly 0 (KL not in the reward)
GROUP_CENTRED = {
    "grpo": dict(estimator=Estimator.grpo),
    "grpo_no_std": dict(estimator=Estimator.grpo, grpo_scale_by_std=False),
    "rloo": dict(estimator=Estimator.rloo),
    "reinforce_baseline_group": dict(estimator=Estimator.reinforce_baseline, reinforce_baseline=Baseline.group),
    "reinforce_pp_group_baseline": dict(estimator=Estimator.reinforce_pp, reinforce_pp_group_baseline=True),
}


def masks(shape: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask (B, T) of the tokens that train, valid (B,)): sample 2 is invalid (reward.invalid: drop)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    if shape == "episode":  # an observation of 1-2 tokens after the first model turn
        for i in range(B):
            start = int(torch.randint(1, max(int(lengths[i]) - 1, 2), (1,), generator=g))
            mask[i, start: start + 1 + i % 2] = 0.0
            mask[i, 0] = 1.0
    valid = torch.ones(B, dtype=torch.bool)
    valid[2] = False
    return mask * valid[:, None], valid


def garbage(x: torch.Tensor, mask: torch.Tensor, seed: int) -> torch.Tensor:
    """x with masked positions overwritten by values that poison any sum they leak into."""
    junk = torch.tensor([math.inf, -math.inf, math.nan, 1e30])[torch.arange(x.numel()) % 4].view_as(x)
    return torch.where(mask > 0, x, junk.roll(seed))


def scores(seed: int, all_equal_second_group: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + seed)
    s = torch.randint(0, 3, (B,), generator=g).float()
    if all_equal_second_group:
        s[GROUP:] = 1.0
    return s


# ---------------------------------------------------------------- an all-equal group gets exactly 0


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("name", sorted(GROUP_CENTRED))
def test_an_all_equal_group_gets_exactly_zero_advantage(name, normalize, shape, seed):
    cfg = AlgorithmConfig(**GROUP_CENTRED[name], normalize_advantages=normalize, kl_placement=KLPlacement.loss)
    mask, valid = masks(shape, seed)
    kl = torch.rand(B, T, generator=torch.Generator().manual_seed(seed))  # in the loss: must not enter advantages
    adv, _ = advantages(cfg, scores(seed, True), kl, 0.1, mask, None, GROUP, valid)
    assert torch.equal(adv[GROUP:], torch.zeros(GROUP, T))
    assert torch.isfinite(adv).all() and torch.equal(adv[mask == 0], torch.zeros(int((mask == 0).sum())))


# ---------------------------------------------------------------- a failure is never a score


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", sorted(GROUP_CENTRED) + ["reinforce_baseline_batch", "reinforce_pp"])
def test_an_invalid_samples_score_changes_no_advantage(name, seed):
    """A sample no source could judge (valid False) is out of every baseline and the normalisation:
    whatever score it carries, every advantage is the same."""
    kw = {"reinforce_baseline_batch": dict(estimator=Estimator.reinforce_baseline, reinforce_baseline=Baseline.batch),
          "reinforce_pp": dict(estimator=Estimator.reinforce_pp)}.get(name) or GROUP_CENTRED[name]
    cfg = AlgorithmConfig(**kw, kl_placement=KLPlacement.loss)
    mask, valid = masks("single_turn", seed)
    s = scores(seed, False)
    zero = torch.zeros(B, T)
    low, _ = advantages(cfg, s, zero, 0.0, mask, None, GROUP, valid)
    s[2] = 1e6  # the invalid sample
    high, _ = advantages(cfg, s, zero, 0.0, mask, None, GROUP, valid)
    assert torch.equal(low, high) and torch.equal(low[2], torch.zeros(T))


@pytest.mark.parametrize("seed", SEEDS)
def test_a_failed_source_marks_the_sample_invalid_and_never_adds_a_score(seed):
    g = torch.Generator().manual_seed(seed)
    runs = {name: SourceRun([None if torch.rand(1, generator=g) < 0.3 else float(torch.rand(1, generator=g))
                             for _ in range(B)]) for name in ("a", "b")}
    total, invalid = combine(runs, {"a": 1.0, "b": 0.5})
    for i in range(B):
        failed = runs["a"].scores[i] is None or runs["b"].scores[i] is None
        assert invalid[i] == failed
        if not failed:
            assert total[i] == pytest.approx(runs["a"].scores[i] + 0.5 * runs["b"].scores[i])


@pytest.mark.parametrize("seed", SEEDS)
def test_a_weight_zero_source_changes_nothing(seed):
    g = torch.Generator().manual_seed(seed)
    draw = lambda p: [None if torch.rand(1, generator=g) < p else float(torch.rand(1, generator=g)) for _ in range(B)]
    trained = {"rm": SourceRun(draw(0.2))}
    reported = SourceRun(draw(0.5))  # fails on about half the samples: a metric, it must not matter
    assert combine(trained | {"math": reported}, {"rm": 1.0, "math": 0.0}) == combine(trained, {"rm": 1.0})


# ---------------------------------------------------------------- masked tokens get exactly zero gradient


def micro_batch(shape: str, seed: int, requires_grad: bool = True):
    g = torch.Generator().manual_seed(seed)
    mask, _ = masks(shape, seed)
    logits = torch.randn(B, T, V, generator=g)
    ids = torch.randint(0, V, (B, T + 1), generator=g)
    lp = A.logprobs_from_logits(logits, ids[:, 1:])
    mb = {"input_ids": ids, "mask": mask,
          "old_logprobs": garbage(lp + 0.3 * torch.randn(B, T, generator=g), mask, seed),
          "ref_logprobs": garbage(lp + 0.3 * torch.randn(B, T, generator=g), mask, seed + 1),
          "advantages": garbage(torch.randn(B, T, generator=g), mask, seed + 2)}
    return logits.requires_grad_(requires_grad), mb


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("loss", LOSSES)
def test_masked_tokens_get_exactly_zero_gradient(loss, agg, shape, seed):
    """Padding, observation tokens and invalid samples: no gradient at all reaches their logits, whatever
    garbage their old/ref logprobs and advantages hold (KL in the loss and an entropy bonus included)."""
    logits, mb = micro_batch(shape, seed)
    cfg = AlgorithmConfig(policy_loss=loss, loss_aggregation=agg, kl_placement=KLPlacement.loss, entropy_coef=0.01)
    total = A.aggregate_total(mb["mask"], agg.value)
    out, _ = policy_loss(logits, mb, cfg, 0.1, 0.7, 4, total, agg.value, norm_tokens=T)
    out.backward()
    masked = mb["mask"] == 0
    assert torch.isfinite(out) and torch.isfinite(logits.grad).all()
    assert torch.equal(logits.grad[masked], torch.zeros(int(masked.sum()), V))
    assert logits.grad[~masked].abs().sum() > 0


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("agg", AGGS)
def test_masked_tokens_get_no_value_gradient(agg, shape, seed):
    g = torch.Generator().manual_seed(seed)
    mask, _ = masks(shape, seed)
    values = torch.randn(B, T, generator=g).requires_grad_(True)
    old, returns = (garbage(torch.randn(B, T, generator=g), mask, seed + k) for k in (0, 1))
    loss, _ = A.ppo_value_loss(values, old, returns, mask, 0.2, agg.value, A.aggregate_total(mask, agg.value), T)
    loss.backward()
    assert torch.isfinite(loss) and torch.equal(values.grad[mask == 0], torch.zeros(int((mask == 0).sum())))


# ---------------------------------------------------------------- one unit per metric, every aggregation


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("loss", LOSSES)
def test_every_metric_is_a_per_token_mean_in_every_aggregation(loss, shape, seed):
    """entropy, KL, clip fraction, approx KL and the ratio: one value whatever the aggregation, the mean
    over response tokens; micro-batches weighted by their token share (worker._share) add up to it."""
    logits, mb = micro_batch(shape, seed, requires_grad=False)
    mask = mb["mask"]
    lp = A.logprobs_from_logits(logits / 0.7, mb["input_ids"][:, 1:])
    ent = A.entropy_from_logits(logits / 0.7, mask)
    kl = A.kl_penalty(lp, mb["ref_logprobs"], "k3", mask)
    want = {"entropy_token": A.masked_mean(ent, mask), "kl_token": A.masked_mean(kl, mask)}
    seen = []
    for agg in AGGS:
        cfg = AlgorithmConfig(policy_loss=loss, loss_aggregation=agg, kl_placement=KLPlacement.loss)
        tokens = float(mask.sum())
        whole = {}
        for rows in (slice(0, 3), slice(3, B)):  # two micro-batches of one mini-batch
            part = {k: v[rows] for k, v in mb.items()}
            total = A.aggregate_total(mask, agg.value)
            _, terms = policy_loss(logits[rows], part, cfg, 0.1, 0.7, 4, total, agg.value, norm_tokens=T)
            for k in ("entropy_token", "kl_token", "clip_frac", "approx_kl"):
                whole[k] = whole.get(k, 0.0) + float(terms[k]) * _share(part, tokens)
        _, pm = L.POLICY_LOSSES[loss.value](lp, mb["old_logprobs"], mb["advantages"], mask, 0.2, 0.28, agg.value,
                                            None, None, T)
        whole["ratio_mean"] = float(pm["ratio_mean"])
        seen.append(whole)
        for k, v in want.items():
            assert whole[k] == pytest.approx(float(v), rel=1e-5, abs=1e-7), (agg, k)
    for other in seen[1:]:
        assert other == pytest.approx(seen[0], rel=1e-5, abs=1e-7)


# ---------------------------------------------------------------- a different seed, a different stream


@pytest.mark.parametrize("a, b", list(itertools.combinations(SEEDS + [7, 12345], 2)))
def test_different_run_seeds_sample_different_streams(a, b):
    keys = [(step, index) for step in range(3) for index in range(4)]
    first = [request_seed(a, *k) for k in keys]
    assert first == [request_seed(a, *k) for k in keys]  # the same seed: the same stream
    assert all(x != y for x, y in zip(first, (request_seed(b, *k) for k in keys)))

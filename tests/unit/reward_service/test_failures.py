"""A failure is never a score (issue 25, items 5 and 12): a sample a source could not judge (a timeout,
an exception, NaN, a failed episode) is masked out of the loss and the group baselines by default and
counted; `invalid: zero` still trains it as 0. Reward metrics are raw; evaluation has no shaping.

Hand example used throughout: one prompt, 4 samples "a", "bb", "ccc", "dddd" scored by their length
(1, 2, 3, 4) over HTTP, the server never answering for "bb".
  drop: GRPO over [1, 3, 4]: mean 8/3, centred [-5/3, 1/3, 4/3], unbiased std sqrt(7/3) = 1.527525
        -> [-1.091089, 0.218218, 0.872872], and exactly 0 for "bb"
  zero: GRPO over [1, 0, 3, 4]: mean 2, centred [-1, -2, 1, 2], std sqrt(10/3) = 1.825742
        -> [-0.547723, -1.095445, 0.547723, 1.095445]
"""

import dataclasses
import math
import sys
from pathlib import Path

import pytest
import torch

from learner.config import AlgorithmConfig, Estimator, GRPOConfig, LearnerConfig
from learner.experience import ForwardSettings, make_experience
from learner.micro_batch_loss import LossSettings, policy_loss
from learner.models import build_policy
from learner.tiny_gpt import char_tokenizer
from orchestrator.loop.dynamic_sampling import informative
from orchestrator.loop.step_metrics import batch_metrics
from reward_service.config import InvalidPolicy, Normalization, RewardConfig, RewardSource, SourceKind
from reward_service.reference import ReferenceModel
from reward_service.service import ScoringService
from rollout.types import RolloutBatch
from runtime.logprobs import SamplerSettings

sys.path.insert(0, str(Path(__file__).parent))
from test_remote import Server, lengths  # noqa: E402  (the loopback server of the remote tests)

tok = char_tokenizer()
RESPONSES = ["a", "bb", "ccc", "dddd"]


def group_of(responses, prompt="1+1="):
    """One prompt's samples, as the rollout returns them."""
    p = tok(prompt, add_special_tokens=False).input_ids
    r = [tok(x, add_special_tokens=False).input_ids for x in responses]
    n = len(responses)
    return RolloutBatch([0] * n, [p] * n, r, [[-1.0] * len(x) for x in r], list(responses), ["stop"] * n)


@pytest.fixture
def bb_never_answered():
    s = Server(lengths, hold=lambda payload: payload["responses"] == ["bb"])
    yield s.url
    s.close()


def remote_cfg(url, **kw) -> RewardConfig:
    # one chunk per sample, so the held one marks only "bb"; no retry: its one attempt times out
    source = RewardSource(kind=SourceKind.remote, url=url, timeout_s=0.3, max_retries=0, max_concurrency=4)
    return RewardConfig(sources=[source], **kw)


def learner_view(tiny_model, batch, scored):
    """The advantages (per sample, on its response tokens), the loss mask and the gradient each
    sample's tokens get, through the learner's own experience and loss code (after the reference
    phase, as the loop runs it)."""
    scored = dataclasses.replace(scored, ref_logprobs=ReferenceModel(tiny_model).logprobs(batch))
    policy = build_policy(LearnerConfig(model_path=tiny_model), value_head=False)
    algo = AlgorithmConfig(estimator=Estimator.grpo, grpo=GRPOConfig(scale_by_std=True))
    exp = make_experience(
        policy,
        None,
        batch,
        scored,
        algo,
        0.0,
        ForwardSettings(SamplerSettings(n_samples_per_prompt=len(batch)), pad_id=0, micro=len(batch), rank=0, world=1),
    )
    mb = exp.rows(torch.arange(len(batch)))
    logits, _ = policy(mb.input_ids, mb.attention_mask, mb.position_ids)
    logits.retain_grad()
    loss, _ = policy_loss(logits, mb, algo, 0.0, LossSettings(1.0, 1024, float(mb.mask.sum()), "token_mean"))
    loss.backward()
    response = torch.zeros_like(exp.mask)  # the response tokens, whether or not they train
    for i, r in enumerate(batch.response_ids):
        start = len(batch.prompt_ids[i]) - 1
        response[i, start : start + len(r)] = 1.0
    adv = [exp.advantages[i][response[i] > 0] for i in range(len(batch))]
    assert all(torch.all(a == a[0]) for a in adv)  # an outcome advantage: one value per sample
    return torch.stack([a[0] for a in adv]), exp.mask, logits.grad.abs().sum(-1)


def test_by_default_a_timed_out_sample_is_masked_out_of_loss_and_baseline_and_counted(tiny_model, bb_never_answered):
    cfg = remote_cfg(bb_never_answered)
    assert cfg.invalid == InvalidPolicy.drop  # the default
    batch = group_of(RESPONSES)
    scored = ScoringService(cfg, tiny_model).score(batch, [{}])
    assert scored.invalid == [False, True, False, False] and scored.valid == [True, False, True, True]
    m = batch_metrics(batch, scored)
    assert m["reward/timeouts"] == 1 and m["reward/dropped_samples"] == 1 and m["reward/invalid_frac"] == 0.25
    assert m["reward/mean"] == pytest.approx(8 / 3) and m["reward/min"] == 1.0  # a failure is not a reward of 0
    adv, mask, grad = learner_view(tiny_model, batch, scored)
    assert torch.allclose(adv, torch.tensor([-1.091089, 0.0, 0.218218, 0.872872]), atol=1e-5)
    assert adv[1] == 0 and mask[1].sum() == 0 and torch.all(grad[1] == 0)  # exactly nothing from "bb"
    assert all(grad[i].sum() > 0 for i in (0, 2, 3))


def test_invalid_zero_still_trains_a_failure_as_reward_0(tiny_model, bb_never_answered):
    batch = group_of(RESPONSES)
    scored = ScoringService(remote_cfg(bb_never_answered, invalid=InvalidPolicy.zero), tiny_model).score(batch, [{}])
    assert scored.rewards == [1.0, 0.0, 3.0, 4.0] and scored.valid == [True] * 4 and scored.invalid[1]
    adv, _, grad = learner_view(tiny_model, batch, scored)
    assert torch.allclose(adv, torch.tensor([-0.547723, -1.095445, 0.547723, 1.095445]), atol=1e-5)
    assert grad[1].sum() > 0


def test_a_batch_nobody_could_judge_trains_on_nothing(tiny_model):
    cfg = RewardConfig(sources=[RewardSource(kind=SourceKind.function, function="user_rewards:fragile")])
    batch = group_of(["nan", "nan"])  # fragile returns NaN for "nan": could not judge
    scored = ScoringService(cfg, tiny_model).score(batch, [{}])
    assert scored.valid == [False, False] and scored.rewards == [0.0, 0.0]
    m = batch_metrics(batch, scored)
    assert m["reward/dropped_samples"] == 2 and math.isnan(m["reward/mean"])
    adv, mask, grad = learner_view(tiny_model, batch, scored)
    assert torch.all(adv == 0) and mask.sum() == 0 and torch.all(grad == 0)


def test_a_wrong_answer_is_a_score_a_broken_episode_is_not(tiny_model):
    cfg = RewardConfig(sources=[RewardSource(kind=SourceKind.math_answer)])
    batch = group_of(["no number here", "2", "2"])
    batch.env_failure = ["", "", "timeout"]  # the third episode's environment timed out: its "2" is no answer
    scored = ScoringService(cfg, tiny_model).score(batch, [{"answer": "2"}])
    assert scored.invalid == [False, False, True] and scored.rewards == [0.0, 1.0, 0.0]
    assert math.isnan(scored.components["math_answer"][2])  # not counted as accuracy either
    assert batch_metrics(batch, scored)["reward/accuracy"] == 0.5


def test_dynamic_sampling_sees_only_the_samples_that_train():
    # [1, 1, dropped as 0]: all equal among those that train, so nothing to learn
    assert not informative([1.0, 1.0, 0.0], [True, True, False])
    assert informative([1.0, 0.0, 0.0], [True, True, False])


def test_reward_mean_is_the_raw_reward_under_batch_normalisation(tiny_model):
    """Issue 25, item 12: reward/mean (the console's reward, pipeline.png) was the normalised reward,
    0 by construction under normalization: batch."""
    cfg = RewardConfig(
        sources=[RewardSource(kind=SourceKind.function, function="user_rewards:length")],
        normalization=Normalization.batch,
        overlong_buffer=2,
        overlong_max_tokens=4,
    )
    batch = group_of(RESPONSES)
    scored = ScoringService(cfg, tiny_model).score(batch, [{}])
    assert sum(scored.rewards) == pytest.approx(0.0, abs=1e-6)  # what trains is whitened...
    m = batch_metrics(batch, scored)
    assert m["reward/mean"] == pytest.approx(2.5) and m["reward/max"] == 4.0  # ...what is shown is raw
    assert m["reward/overlong/mean"] == pytest.approx(-0.375)  # shaping is reported on its own: 0, 0, -.5, -1


def test_evaluation_has_no_overlong_penalty(tiny_model):
    cfg = RewardConfig(
        sources=[RewardSource(kind=SourceKind.function, function="user_rewards:length")],
        overlong_buffer=2,
        overlong_max_tokens=4,
    )
    service, batch = ScoringService(cfg, tiny_model), group_of(RESPONSES)
    # 1, 2, 3, 4 tokens: free up to 2, then -1/2 per token: 0, 0, -.5, -1
    assert service.score(batch, [{}]).rewards == [1.0, 2.0, 2.5, 3.0]
    evaluated = service.evaluate(batch, [{}], with_reference=False)
    assert evaluated.rewards == [1.0, 2.0, 3.0, 4.0] and "overlong" not in evaluated.components


@pytest.mark.parametrize(
    "policy, want",
    [
        # zero: normalised over raw [1, 0, 1, 0]: mean 1/2, unbiased std sqrt(1/3) -> +-0.866025; the failure is
        # the wrong answer
        (InvalidPolicy.zero, [0.866025, -0.866025, 0.866025, -0.866025]),
        # drop: over [1, 0, 1]: mean 2/3, std sqrt(1/3) -> 0.577350, -1.154701; the failure left out (0, masked)
        (InvalidPolicy.drop, [0.577350, -1.154701, 0.577350, 0.0]),
    ],
)
def test_invalid_zero_is_a_wrong_answer_also_under_normalisation(tiny_model, policy, want):
    """Review A, item 9: under zero the failure was set to 0 after normalising, so with normalization:
    batch the wrong answer trained at -1.155 and the failure at 0: not "like a wrong answer"."""
    cfg = RewardConfig(
        sources=[RewardSource(kind=SourceKind.math_answer)], normalization=Normalization.batch, invalid=policy
    )
    batch = group_of(["#### 2", "#### 3", "#### 2", "#### 2"])
    batch.env_failure = ["", "", "", "error"]  # the last episode broke off: could not be judged
    scored = ScoringService(cfg, tiny_model).score(batch, [{"answer": "2"}])
    assert scored.invalid == [False, False, False, True]
    assert scored.valid == [True, True, True, policy == InvalidPolicy.zero]
    assert scored.rewards == pytest.approx(want, abs=1e-6)
    if policy == InvalidPolicy.zero:
        assert scored.rewards[3] == scored.rewards[1]

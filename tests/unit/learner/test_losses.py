"""learner/losses.py (GSPO, CISPO, REINFORCE++) and Dr. GRPO's seq_sum_norm aggregation against
small examples computed by hand from each paper's formula (worked out in the comments).

The running example: 2 sequences x 3 tokens, the second padded after 2 tokens."""

import math

import pytest
import torch

from learner import algorithms as A
from learner import losses as L
from learner.config import (
    AlgorithmConfig,
    CISPOConfig,
    Estimator,
    KLPlacement,
    LossAggregation,
    PolicyLoss,
    ReinforcePPConfig,
)
from learner.experience import ForwardSettings, advantages, make_experience
from learner.micro_batch_loss import LossSettings, loss_norm_tokens, policy_loss
from rollout.config import SamplingConfig
from runtime.logprobs import SamplerSettings, logprobs_from_logits
from tests.helpers import close, make_micro_batch

t = torch.tensor
MASK = t([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def pad(x, fill):
    """Two more padding columns holding garbage: a result must not move."""
    return torch.cat([x, torch.full((x.shape[0], 2), fill)], -1)


def grad(fn, lp, old, adv, mask, *clip, **agg):
    """fn (a policy loss) on lp, old, adv, mask and `agg` (PolicyLossInput's fields), with clip_eps and
    clip_eps_high `clip`: the loss, d loss / d lp, the metrics."""
    lp = lp.clone().requires_grad_(True)
    loss, metrics = fn(A.PolicyLossInput(lp, old, adv, mask, **agg), *clip)
    loss.backward()
    return loss.detach(), lp.grad, metrics


# ---------------------------------------------------------------- Dr. GRPO: seq_sum_norm


def test_seq_sum_norm_hand_example():
    # token sums 1+2+3 = 6 and 4+5 = 9 (99 is padding), over norm_tokens 4: 1.5 and 2.25; mean 1.875
    x = t([[1.0, 2.0, 3.0], [4.0, 5.0, 99.0]])
    assert close(A.aggregate(x, MASK, "seq_sum_norm", norm_tokens=4), 1.875)
    assert A.aggregate_total(MASK, "seq_sum_norm") == 2.0  # sequences, as seq_mean
    # micro-batches with the mini-batch's total add up: 1.5 / 2 + 2.25 / 2
    parts = A.aggregate(x[:1], MASK[:1], "seq_sum_norm", 2.0, 4) + A.aggregate(x[1:], MASK[1:], "seq_sum_norm", 2.0, 4)
    assert close(parts, 1.875)
    assert close(A.aggregate(pad(x, float("inf")), pad(MASK, 0.0), "seq_sum_norm", norm_tokens=4), 1.875)
    with pytest.raises(ValueError, match="norm_tokens"):
        A.aggregate(x, MASK, "seq_sum_norm")


def test_seq_sum_norm_gives_every_token_the_same_gradient_whatever_its_sequences_length():
    # ratio 1, A = 1 everywhere: the loss is -(3 + 2) / 4 / 2 = -0.625 and d loss / d logp = -1 / (4 * 2)
    # on every response token. seq_mean would give -1/6 (length 3) and -1/4 (length 2): Dr. GRPO's length bias.
    lp = t([[-1.0, -2.0, -0.5], [-1.5, -0.25, 0.0]])
    loss, g, _ = grad(
        A.ppo_policy_loss, lp, lp.clone(), MASK.clone(), MASK, 0.2, aggregation="seq_sum_norm", norm_tokens=4
    )
    assert close(loss, -0.625) and close(g, -0.125 * MASK)
    _, g_seq, _ = grad(A.ppo_policy_loss, lp, lp.clone(), MASK.clone(), MASK, 0.2, aggregation="seq_mean")
    assert close(g_seq, t([[-1 / 6, -1 / 6, -1 / 6], [-0.25, -0.25, 0.0]]))


# ---------------------------------------------------------------- GSPO


# log-ratios row 0: .1 .2 .3 (mean .2, s_0 = e^.2 = 1.221403), row 1: -.1 -.3 (mean -.2, s_1 = e^-.2 = 0.818731)
GSPO_OLD = t([[-1.1, -2.2, -0.8], [-1.4, 0.05, 0.0]])
GSPO_LP = GSPO_OLD + t([[0.1, 0.2, 0.3], [-0.1, -0.3, 0.0]])
GSPO_ADV = t([[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]])  # one outcome advantage per sequence, broadcast


def test_gspo_hand_example_value_and_gradient():
    # clip [0.8, 1.2]. Row 0: A = 1, s_0 = 1.221403 > 1.2: min(-1.221403, -1.2) as a loss max -> -1.2, clipped,
    # no gradient. Row 1: A = -1, s_1 = 0.818731 inside: +0.818731 on each token.
    # seq_mean: (-1.2 + 0.818731) / 2 = -0.1906346; d/d logp on row 1's tokens: -A * s_1 / (|y_1| * G) = 0.818731 / 4
    loss, g, m = grad(L.gspo_policy_loss, GSPO_LP, GSPO_OLD, GSPO_ADV, MASK, 0.2, aggregation="seq_mean")
    assert close(loss, -0.1906346)
    assert close(g, t([[0.0, 0.0, 0.0], [0.2046828, 0.2046828, 0.0]]))
    # every token of row 0 is clipped: 3 of 5; ratio_mean over tokens (3 * 1.221403 + 2 * 0.818731) / 5
    assert close(m["clip_frac"], 0.6) and close(m["ratio_mean"], 1.060334)
    # token_mean: (3 * -1.2 + 2 * 0.818731) / 5 = -0.3925076; row 1's gradient 0.818731 / 5
    loss, g, _ = grad(L.gspo_policy_loss, GSPO_LP, GSPO_OLD, GSPO_ADV, MASK, 0.2)
    assert close(loss, -0.3925076) and close(g[1], t([0.1637462, 0.1637462, 0.0]))


def test_gspo_gradient_is_the_sequence_objectives():
    # clip-higher 0.3: s_0 = 1.221403 < 1.3, nothing clipped. GSPO's objective (1/G) sum_i s_i A_i has
    # d/d logp_t = s_i A_i / (|y_i| G): row 0 -1.221403 / 6 = -0.2035671, row 1 0.818731 / 4 = 0.2046828
    # (signs: the loss is minus the objective). Value (-1.221403 + 0.818731) / 2 = -0.201336
    loss, g, m = grad(L.gspo_policy_loss, GSPO_LP, GSPO_OLD, GSPO_ADV, MASK, 0.2, 0.3, aggregation="seq_mean")
    assert close(loss, -0.201336) and close(m["clip_frac"], 0.0)
    assert close(g, t([[-0.2035671] * 3, [0.2046828, 0.2046828, 0.0]]))
    # the same as differentiating the sequence-level objective itself
    lp = GSPO_LP.clone().requires_grad_(True)
    s = A.masked_mean(lp - GSPO_OLD, MASK, dim=-1).exp()
    (-(s * GSPO_ADV[:, 0]).mean()).backward()
    assert close(lp.grad, g)


def test_gspo_padding_and_weights():
    loss, m = L.gspo_policy_loss(A.PolicyLossInput(GSPO_LP, GSPO_OLD, GSPO_ADV, MASK, aggregation="seq_mean"), 0.2)
    padded, mp = L.gspo_policy_loss(
        A.PolicyLossInput(
            pad(GSPO_LP, -math.inf), pad(GSPO_OLD, 1e6), pad(GSPO_ADV, 1e6), pad(MASK, 0.0), aggregation="seq_mean"
        ),
        0.2,
    )
    assert close(loss, padded) and all(close(m[k], mp[k]) for k in m)
    # off-policy weights multiply each token's term, as in PPO: weight 2 on row 1 -> (-1.2 + 2 * 0.818731) / 2
    w = t([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]])
    weighted, _ = L.gspo_policy_loss(
        A.PolicyLossInput(GSPO_LP, GSPO_OLD, GSPO_ADV, MASK, aggregation="seq_mean", weights=w), 0.2
    )
    assert close(weighted, 0.218731)


# ---------------------------------------------------------------- CISPO


# ratios row 0: 1.5, 1, 0.5; row 1: 1.1, 0.7
CISPO_LP = t([[-1.0, -2.0, -0.5], [-1.5, -0.25, 0.0]])
CISPO_OLD = CISPO_LP - torch.log(t([[1.5, 1.0, 0.5], [1.1, 0.7, 1.0]]))
CISPO_ADV = t([[2.0, 2.0, 2.0], [-1.0, -1.0, 0.0]])


def test_cispo_hand_example_value_and_gradient():
    # upper bound 1.2, no lower one: weights 1.2, 1, 0.5 | 1.1, 0.7. Per token -w * A * logp:
    # 2.4, 4, 0.5 | -1.65, -0.175; token_mean 5.075 / 5 = 1.015. d/d logp = -w * A / 5: every token has one,
    # the clipped 1.5 too (-0.48; PPO would give it 0)
    loss, g, m = grad(L.cispo_policy_loss, CISPO_LP, CISPO_OLD, CISPO_ADV, MASK, None, 0.2)
    assert close(loss, 1.015)
    assert close(g, t([[-0.48, -0.4, -0.2], [0.22, 0.14, 0.0]]))
    # one weight cut of 5; ratio mean 4.8 / 5; k3: (0.094535 + 0 + 0.193147 + 0.0046898 + 0.0566749) / 5
    assert close(m["clip_frac"], 0.2) and close(m["ratio_mean"], 0.96) and close(m["approx_kl"], 0.0698092)


def test_cispo_optional_lower_bound():
    # clip_eps 0.2 as a lower bound 0.8: weights 0.5 -> 0.8 and 0.7 -> 0.8: tokens 0.8 and -0.2:
    # (2.4 + 4 + 0.8 - 1.65 - 0.2) / 5 = 1.07; three weights cut
    loss, g, m = grad(L.cispo_policy_loss, CISPO_LP, CISPO_OLD, CISPO_ADV, MASK, 0.2, 0.2)
    assert close(loss, 1.07) and close(m["clip_frac"], 0.6)
    assert close(g, t([[-0.48, -0.4, -0.32], [0.22, 0.16, 0.0]]))


def test_cispo_padding_never_changes_the_result():
    loss, m = L.cispo_policy_loss(A.PolicyLossInput(CISPO_LP, CISPO_OLD, CISPO_ADV, MASK), None, 0.2)
    padded, mp = L.cispo_policy_loss(
        A.PolicyLossInput(pad(CISPO_LP, -math.inf), pad(CISPO_OLD, 1e6), pad(CISPO_ADV, 1e6), pad(MASK, 0.0)), None, 0.2
    )
    assert close(loss, padded) and all(close(m[k], mp[k]) for k in m)


# ---------------------------------------------------------------- REINFORCE++

SCORES = t([1.0, 0.0])
KL = t([[0.1, 0.2, 0.3], [0.5, 0.4, 9.0]])  # 9 is padding


def test_reinforce_pp_hand_example():
    # kl_coef 0.5: token rewards -0.05, -0.1, -0.15 + 1 | -0.25, -0.2 + 0
    # gamma 1, reward-to-go: 0.7, 0.75, 0.85 | -0.45, -0.2
    assert close(A.reinforce_pp_returns(SCORES, KL, 0.5, MASK, 1.0), t([[0.7, 0.75, 0.85], [-0.45, -0.2, 0.0]]))
    # gamma 0.5: 0.85; -0.1 + 0.5 * 0.85 = 0.325; -0.05 + 0.5 * 0.325 = 0.1125 | -0.2; -0.25 + 0.5 * -0.2 = -0.35
    assert close(A.reinforce_pp_returns(SCORES, KL, 0.5, MASK, 0.5), t([[0.1125, 0.325, 0.85], [-0.35, -0.2, 0.0]]))
    # group baseline (one group of 2, mean 0.5): scores 0.5, -0.5 -> rewards -0.05, -0.1, 0.35 | -0.25, -0.7
    base = A.reinforce_pp_returns(SCORES, KL, 0.5, MASK, 1.0, group_size=2, group_baseline=True)
    assert close(base, t([[0.2, 0.25, 0.35], [-0.95, -0.7, 0.0]]))
    padded = A.reinforce_pp_returns(SCORES, pad(KL, 1e6), 0.5, pad(MASK, 0.0), 1.0)
    assert close(padded[:, :3], A.reinforce_pp_returns(SCORES, KL, 0.5, MASK, 1.0)) and close(padded[:, 3:], 0.0)


def test_reinforce_pp_advantages_are_whitened_over_the_whole_batch():
    # returns 0.7, 0.75, 0.85, -0.45, -0.2: mean 0.33, squared deviations 0.1369 + 0.1764 + 0.2704 + 0.6084
    # + 0.2809 = 1.473, unbiased variance 1.473 / 4 = 0.36825; adv = (ret - 0.33) / sqrt(0.36825)
    cfg = AlgorithmConfig(
        estimator=Estimator.reinforce_pp, kl_placement=KLPlacement.reward, reinforce_pp=ReinforcePPConfig(gamma=1.0)
    )
    adv, returns = advantages(cfg, SCORES, KL, 0.5, MASK, None, 2, t([True, True]))
    want = (t([[0.7, 0.75, 0.85], [-0.45, -0.2, 0.33]]) - 0.33) / math.sqrt(0.36825)  # padding comes out 0
    assert returns is None and close(adv, want)
    # KL in the loss: none in the reward. returns 0.85 x 3 | 0 x 2: mean 0.51, var (3 * 0.34^2 + 2 * 0.51^2) / 4
    cfg.kl_placement = KLPlacement.loss
    adv, _ = advantages(cfg, SCORES, KL, 0.5, MASK, None, 2, t([True, True]))
    std = math.sqrt((3 * 0.34**2 + 2 * 0.51**2) / 4)
    assert close(adv, t([[0.34, 0.34, 0.34], [-0.51, -0.51, 0.0]]) / std)


# ---------------------------------------------------------------- the learner's dispatch


@pytest.mark.parametrize("kind", list(PolicyLoss))
@pytest.mark.parametrize("agg", ["token_mean", "seq_sum_norm"])
def test_policy_loss_dispatches_on_algorithm_policy_loss(kind, agg):
    g = torch.Generator().manual_seed(0)
    logits, temperature = torch.randn(2, 3, 5, generator=g), 0.7
    ids = torch.randint(0, 5, (2, 4), generator=g)
    mb = make_micro_batch(
        ids, MASK, old_logprobs=-torch.rand(2, 3, generator=g), advantages=torch.randn(2, 3, generator=g) * MASK
    )
    algo = AlgorithmConfig(
        policy_loss=kind,
        kl_placement=KLPlacement.reward,
        clip_eps=0.1,
        clip_eps_high=0.3,
        cispo=CISPOConfig(clip_low=0.4),
        loss_aggregation=LossAggregation(agg),
    )
    loss, terms = policy_loss(
        logits, mb, algo, 0.0, LossSettings(temperature, 4, A.aggregate_total(MASK, agg), agg, norm_tokens=6)
    )
    lp = logprobs_from_logits(logits / temperature, ids[:, 1:])
    low = 0.4 if kind == PolicyLoss.cispo else 0.1  # cispo's lower bound is its own key
    x = A.PolicyLossInput(lp, mb.old_logprobs, mb.advantages, MASK, agg, A.aggregate_total(MASK, agg), None, 6)
    want, wm = L.POLICY_LOSSES[kind.value](x, low, 0.3)
    assert close(loss, want, 1e-6) and close(terms["clip_frac"], wm["clip_frac"])
    assert L.POLICY_LOSSES["ppo"] is A.ppo_policy_loss


def test_the_learner_takes_the_samplers_settings_as_rollout_sampling_holds_them():
    sampling = SamplingConfig(temperature=0.7, top_k=20, top_p=0.9, n_samples_per_prompt=3, max_new_tokens=48, seed=5)
    assert SamplerSettings.of(sampling) == SamplerSettings(0.7, 20, 0.9, 3, 48)
    assert SamplerSettings.of(SamplingConfig()) == SamplerSettings()  # the same defaults


def test_seq_sum_norm_defaults_to_the_longest_response():
    sampling = SamplerSettings(max_new_tokens=48)
    assert loss_norm_tokens(AlgorithmConfig(), sampling) == 48
    assert loss_norm_tokens(AlgorithmConfig(loss_norm_tokens=100), sampling) == 100


def test_an_update_with_reinforce_pp_gspo_and_seq_sum_norm_adds_up_over_micro_batches(tiny_model):
    from transformers import AutoModelForCausalLM

    from learner.models import PolicyValue
    from tests.helpers import make_scored_batch

    batch, scored = make_scored_batch(tiny_model, n_prompts=2, group=4, seed=4)
    policy = PolicyValue(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), False)
    cfg = AlgorithmConfig(
        estimator=Estimator.reinforce_pp,
        reinforce_pp=ReinforcePPConfig(group_baseline=True),
        kl_placement=KLPlacement.reward,
        policy_loss=PolicyLoss.gspo,
        loss_aggregation=LossAggregation.seq_sum_norm,
    )
    sampling = SamplerSettings(n_samples_per_prompt=4)
    exp = make_experience(policy, None, batch, scored, cfg, 0.05, ForwardSettings(sampling, 0, 4, 0, 1))
    # REINFORCE++-baseline: whitened over the batch after the group mean (Hu 2025)
    assert exp.returns is None and close(A.masked_var(exp.advantages, exp.mask), 1.0, 1e-4)
    assert close(A.masked_mean(exp.advantages, exp.mask), 0.0, 1e-5)
    agg, total, norm = "seq_sum_norm", A.aggregate_total(exp.mask, "seq_sum_norm"), loss_norm_tokens(cfg, sampling)

    def loss(rows):
        mb = exp.rows(rows)
        logits, _ = policy(mb.input_ids, mb.attention_mask, mb.position_ids)
        return policy_loss(logits, mb, cfg, 0.05, LossSettings(1.0, 16, total, agg, norm_tokens=norm))[0]

    whole = loss(torch.arange(8))
    assert torch.isfinite(whole) and close(loss(torch.arange(3)) + loss(torch.arange(3, 8)), whole, 1e-6)

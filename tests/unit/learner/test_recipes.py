"""algorithm.method: each named recipe, loaded through the config, computes its paper's advantages and
loss on one example worked out by hand (orchestrator/config/methods.py lists the keys each sets).

The example: 2 prompts x 2 samples, responses of 1, 3, 2 and 2 tokens; scores 1, 0 | 1, 1 (the second
group all equal). The policy gives every token logprob -log 4 (zero logits over 4 tokens); the old
logprobs put the ratio pi/pi_old at 1.5 on the first sample's token and 1 elsewhere; the reference
sits 0.1 below the old logprobs (k1 KL 0.1 per token).
"""

import math

import pytest
import torch

from learner import algorithms as A
from learner.config import Estimator, KLEstimator, KLPlacement, Method, PolicyLoss
from learner.experience import advantages
from learner.micro_batch_loss import LossSettings, policy_loss
from orchestrator.config.load import ConfigError, load_config
from orchestrator.config.methods import RECIPES
from tests.helpers import close, make_micro_batch

t = torch.tensor
MASK = t([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
SCORES = t([1.0, 0.0, 1.0, 1.0])
LP = torch.full((4, 3), -math.log(4.0))
OLD = LP - torch.log(t([[1.5, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]))
REF = OLD - 0.1
BASE = """data:
  task: addition_2digit
  rollout_batch_size: 2
rollout:
  sampling:
    n_samples_per_prompt: 2
    max_new_tokens: 4
learner:
  model_path: builtin://tiny-addition-gpt
algorithm:
  mini_batch_size: 4
  micro_batch_size: 4
  loss_norm_tokens: 4
"""


def load(tmp_path, method: str, *overrides: str, yaml_extra: str = ""):
    path = tmp_path / "c.yaml"
    path.write_text(BASE + f"  method: {method}\n" + yaml_extra)
    return load_config(path, list(overrides))


def advantages_and_loss(cfg, kl_coef: float = 0.0):
    """What the learner computes from this config: experience.advantages, then micro_batch_loss.policy_loss
    (kl_coef: the KL term's coefficient in the loss, where the recipe places it there)."""
    a = cfg.algorithm
    kl = A.kl_penalty(OLD, REF, a.kl_estimator.value, MASK)
    adv, _ = advantages(
        a,
        SCORES,
        kl,
        a.init_kl_coef,
        MASK,
        None,
        cfg.rollout.sampling.n_samples_per_prompt,
        torch.ones(4, dtype=torch.bool),
    )
    mb = make_micro_batch(torch.zeros(4, 4, dtype=torch.long), MASK, old_logprobs=OLD, advantages=adv, ref_logprobs=REF)
    agg = a.loss_aggregation.value
    loss, _ = policy_loss(
        torch.zeros(4, 3, 4),
        mb,
        a,
        kl_coef,
        LossSettings(
            cfg.rollout.sampling.temperature, 16, A.aggregate_total(MASK, agg), agg, norm_tokens=a.loss_norm_tokens
        ),
    )
    return adv, float(loss)


def per_sample(values):
    """(4,) -> (4, 3) on the response tokens."""
    return t(values)[:, None] * MASK


G = 1 / math.sqrt(2)  # GRPO's (1 - .5) / std([1, 0]) with the unbiased std sqrt(.5)


def test_dr_grpo_divides_by_no_std_and_sums_tokens_over_a_constant(tmp_path):
    cfg = load(tmp_path, "dr_grpo")
    a = cfg.algorithm
    assert (a.estimator, a.grpo.scale_by_std, a.normalize_advantages) == (Estimator.grpo, False, False)
    adv, loss = advantages_and_loss(cfg)
    assert torch.equal(adv, per_sample([0.5, -0.5, 0.0, 0.0]))  # r - group mean, nothing else
    # token terms: -.5 * clip(1.5, 1.2) = -.6 | .5 x 3 | 0 | 0; sums / 4 tokens, mean over 4 sequences
    assert close(loss, (-0.6 / 4 + 1.5 / 4) / 4)


def test_grpo_normalises_per_group_and_averages_per_sequence(tmp_path):
    cfg = load(tmp_path, "grpo")
    assert cfg.algorithm.kl_placement == KLPlacement.loss and cfg.algorithm.kl_estimator == KLEstimator.k3
    adv, loss = advantages_and_loss(cfg)
    assert close(adv, per_sample([G, -G, 0.0, 0.0]))
    # per-sequence means: -G * 1.2 (clipped) | G | 0 | 0, then the mean over 4 sequences
    assert close(loss, (-G * 1.2 + G) / 4)


def test_grpo_adds_the_k3_kl_to_the_reference_per_sequence_mean_to_its_loss(tmp_path):
    """log pi - log ref is log 1.5 + .1 on the first sample's token and .1 elsewhere; k3 of x is
    e^-x - 1 + x; seq_mean: sample 0's one token, then 3 sequences of .1-tokens, mean over 4."""
    cfg = load(tmp_path, "grpo")
    k3 = lambda x: math.exp(-x) - 1 + x  # noqa: E731
    want = (k3(math.log(1.5) + 0.1) + 3 * k3(0.1)) / 4  # 0.030801
    _, plain = advantages_and_loss(cfg)
    _, with_kl = advantages_and_loss(cfg, kl_coef=0.5)
    assert close(with_kl - plain, 0.5 * want, 1e-6) and want == pytest.approx(0.030801, abs=1e-6)


def test_dapo_clips_higher_averages_tokens_and_drops_the_kl(tmp_path):
    cfg = load(tmp_path, "dapo")
    assert cfg.algorithm.init_kl_coef == 0.0 and cfg.data.dynamic_sampling
    adv, loss = advantages_and_loss(cfg)
    assert close(adv, per_sample([G, -G, 0.0, 0.0]))
    # -G * 1.28 on the clipped token, G on each of the 3 others, over the 8 response tokens
    assert close(loss, (-G * 1.28 + 3 * G) / 8)


def test_gspo_clips_the_sequence_ratio_in_the_papers_tiny_range(tmp_path):
    cfg = load(tmp_path, "gspo")
    assert cfg.algorithm.policy_loss == PolicyLoss.gspo
    adv, loss = advantages_and_loss(cfg)
    assert close(adv, per_sample([G, -G, 0.0, 0.0]))
    # sequence ratios 1.5 (one token) and 1: -G * 1.0004 | G, per-sequence mean, mean over 4
    assert close(loss, (-G * 1.0004 + G) / 4, 1e-7)


def test_cispo_weights_reinforce_by_the_clipped_ratio(tmp_path):
    cfg = load(tmp_path, "cispo", "algorithm.clip_eps_high=0.3")
    adv, loss = advantages_and_loss(cfg)
    assert close(adv, per_sample([G, -G, 0.0, 0.0]))
    # -sg(min(r, 1.3)) * A * logp: -1.3 * G * (-log 4) | -1 * (-G) * (-log 4) x 3, over 8 tokens
    assert close(loss, (1.3 * G * math.log(4) - 3 * G * math.log(4)) / 8)


def test_reinforce_pp_puts_k1_per_token_in_the_reward_and_whitens_the_returns(tmp_path):
    cfg = load(tmp_path, "reinforce_pp", "algorithm.init_kl_coef=0.5")
    assert cfg.algorithm.kl_placement == KLPlacement.reward and cfg.algorithm.kl_estimator == KLEstimator.k1
    adv, _ = advantages_and_loss(cfg)
    # token rewards -.5 * .1 = -.05 each, the score on the last token; reward-to-go (gamma 1):
    returns = [0.95, -0.15, -0.10, -0.05, 0.90, 0.95, 0.90, 0.95]
    mean = sum(returns) / 8
    std = math.sqrt(sum((r - mean) ** 2 for r in returns) / 7)
    assert close(adv[MASK > 0], t([(r - mean) / std for r in returns]))


def test_rloo_leaves_one_out_of_the_kl_penalised_sequence_reward_unnormalised(tmp_path):
    cfg = load(tmp_path, "rloo", "algorithm.init_kl_coef=0.5")
    assert cfg.algorithm.estimator == Estimator.rloo
    adv, loss = advantages_and_loss(cfg)
    # sequence rewards 1 - .5 * .1, 0 - .5 * .3, 1 - .5 * .2, 1 - .5 * .2 = .95, -.15, .9, .9; minus the other's
    assert close(adv, per_sample([1.1, -1.1, 0.0, 0.0]))
    # token sums over 4 tokens: -1.1 * 1.2 | 1.1 * 3, mean over 4 sequences
    assert close(loss, (-1.1 * 1.2 / 4 + 3.3 / 4) / 4)


def test_a_key_that_contradicts_the_method_is_refused_naming_it(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"command line 'algorithm.normalize_advantages=true': "
        r"algorithm.normalize_advantages: algorithm.method=dr_grpo sets it to false",
    ):
        load(tmp_path, "dr_grpo", "algorithm.normalize_advantages=true")
    # in the file too, with its line; a value equal to the recipe's is fine
    with pytest.raises(
        ConfigError,
        match=r"c.yaml:\d+: algorithm.loss_aggregation: "
        r"algorithm.method=gspo sets it to seq_mean",
    ):
        load(tmp_path, "gspo", yaml_extra="  loss_aggregation: token_mean\n")
    assert load(tmp_path, "gspo", "algorithm.loss_aggregation=seq_mean").algorithm.clip_eps == 3e-4


def test_every_method_has_a_recipe_and_none_changes_nothing(tmp_path):
    assert set(RECIPES) == set(Method)
    plain, none = load(tmp_path, "none"), load_config_without_method(tmp_path)
    assert plain.algorithm == none.algorithm and plain.data == none.data
    assert all(load(tmp_path, m.value, "algorithm.init_kl_coef=0.0").algorithm.method == m for m in Method)


def load_config_without_method(tmp_path):
    path = tmp_path / "plain.yaml"
    path.write_text(BASE)
    return load_config(path)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (
            ["rollout.sampling.repetition_penalty=1.2"],
            "rollout.sampling.repetition_penalty: must be 1.0 \\(off\\) for training",
        ),
        (["learner.lora.rank=4", "learner.lora.dropout=0.1"], "learner.lora.dropout: must be 0 for RL"),
    ],
)
def test_training_refuses_what_the_learner_cannot_reproduce(tmp_path, overrides, key):
    """A sampling penalty the learner does not model, or LoRA dropout, makes the behaviour/old/reference
    logprobs another function than the one the update differentiates."""
    with pytest.raises(ConfigError, match=key):
        load(tmp_path, "none", *overrides)
    assert load(tmp_path, "none", "learner.lora.rank=4").learner.lora.dropout == 0.0


def test_a_method_set_in_code_is_checked_against_its_recipe_naming_the_key(tmp_path):
    """validate(), not only the loader: an AlgorithmConfig(method=dr_grpo) built in code with the plain
    keys would otherwise run GRPO with a std under Dr. GRPO's name."""
    import dataclasses

    from orchestrator.config.validate import validate

    cfg = load(tmp_path, "none")
    coded = dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, method=Method.dr_grpo))
    problems = dict(validate(coded))
    assert "algorithm.method=dr_grpo sets it to false, got true" in problems["algorithm.grpo.scale_by_std"]
    assert "algorithm.loss_aggregation" in problems and "algorithm.normalize_advantages" in problems
    assert not any(k.startswith("algorithm.") for k, _ in validate(load(tmp_path, "dr_grpo")))


@pytest.mark.parametrize("method", ["dapo", "grpo", "rloo"])
def test_a_group_recipe_with_the_agent_endpoint_gets_one_error_that_names_the_method(tmp_path, method):
    """Not "data.dynamic_sampling: turn it off" (the recipe sets it) nor "needs >= 2" then "must be 1"."""
    for n in ("1", "2"):
        with pytest.raises(
            ConfigError, match=f"algorithm.method: algorithm.method={method} is incompatible with the agent endpoint"
        ):
            load(tmp_path, method, "rollout.endpoint.enabled=true", f"rollout.sampling.n_samples_per_prompt={n}")


def test_a_group_estimator_with_the_agent_endpoint_is_refused_without_asking_for_more_samples(tmp_path):
    with pytest.raises(
        ConfigError,
        match="algorithm.estimator: compares the samples of one prompt, and each agent "
        "endpoint episode is its own prompt",
    ) as e:
        load(
            tmp_path,
            "none",
            "rollout.endpoint.enabled=true",
            "rollout.sampling.n_samples_per_prompt=1",
            "algorithm.mini_batch_size=2",
            "algorithm.micro_batch_size=2",
        )
    assert "needs >= 2" not in str(e.value)

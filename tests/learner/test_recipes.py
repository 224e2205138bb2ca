"""algorithm.method: each named recipe, loaded through the config, computes its paper's advantages and
loss on one example worked out by hand (orchestrator/methods.py lists the keys each sets).

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
from learner.worker import policy_loss
from orchestrator.load_config import ConfigError, load_config
from orchestrator.methods import RECIPES

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


def close(x, y, tol=1e-5):
    return torch.allclose(torch.as_tensor(x).float(), torch.as_tensor(y).float(), atol=tol, rtol=0)


def load(tmp_path, method: str, *overrides: str, yaml_extra: str = ""):
    path = tmp_path / "c.yaml"
    path.write_text(BASE + f"  method: {method}\n" + yaml_extra)
    return load_config(path, list(overrides))


def advantages_and_loss(cfg):
    """What the learner computes from this config: experience.advantages, then worker.policy_loss."""
    a = cfg.algorithm
    kl = A.kl_penalty(OLD, REF, a.kl_estimator.value, MASK)
    adv, _ = advantages(a, SCORES, kl, a.init_kl_coef, MASK, None, cfg.rollout.sampling.n_samples_per_prompt,
                        torch.ones(4, dtype=torch.bool))
    mb = {"input_ids": torch.zeros(4, 4, dtype=torch.long), "mask": MASK, "old_logprobs": OLD, "advantages": adv,
          "ref_logprobs": REF}
    agg = a.loss_aggregation.value
    loss, _ = policy_loss(torch.zeros(4, 3, 4), mb, a, 0.0, cfg.rollout.sampling.temperature, 16,
                          A.aggregate_total(MASK, agg), agg, norm_tokens=a.loss_norm_tokens)
    return adv, float(loss)


def per_sample(values):
    """(4,) -> (4, 3) on the response tokens."""
    return t(values)[:, None] * MASK


G = 1 / math.sqrt(2)  # GRPO's (1 - .5) / std([1, 0]) with the unbiased std sqrt(.5)


def test_dr_grpo_divides_by_no_std_and_sums_tokens_over_a_constant(tmp_path):
    cfg = load(tmp_path, "dr_grpo")
    a = cfg.algorithm
    assert (a.estimator, a.grpo_scale_by_std, a.normalize_advantages) == (Estimator.grpo, False, False)
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
    with pytest.raises(ConfigError, match=r"command line 'algorithm.normalize_advantages=true': "
                                          r"algorithm.normalize_advantages: algorithm.method=dr_grpo sets it to false"):
        load(tmp_path, "dr_grpo", "algorithm.normalize_advantages=true")
    # in the file too, with its line; a value equal to the recipe's is fine
    with pytest.raises(ConfigError, match=r"c.yaml:\d+: algorithm.loss_aggregation: "
                                          r"algorithm.method=gspo sets it to seq_mean"):
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



@pytest.mark.parametrize("overrides, key", [
    (["rollout.sampling.repetition_penalty=1.2"], "rollout.sampling.repetition_penalty: must be 1.0 \\(off\\) for training"),
    (["learner.lora.rank=4", "learner.lora.dropout=0.1"], "learner.lora.dropout: must be 0 for RL"),
])
def test_training_refuses_what_the_learner_cannot_reproduce(tmp_path, overrides, key):
    """A sampling penalty the learner does not model, or LoRA dropout, makes the behaviour/old/reference
    logprobs another function than the one the update differentiates."""
    with pytest.raises(ConfigError, match=key):
        load(tmp_path, "none", *overrides)
    assert load(tmp_path, "none", "learner.lora.rank=4").learner.lora.dropout == 0.0

"""Each training-health sign fires on a synthetic metric stream that shows it, naming the sign and its knob,
once until it clears; and stays silent on a healthy stream."""

import json
import math

import pytest

from orchestrator.config.load import load_config
from orchestrator.config.schema import HealthConfig
from orchestrator.loop.health import SIGNS, Health, applicable
from tests.small_loop import DEFAULT

STEPS = 40


def healthy(step: int) -> dict[str, float]:
    """A run that learns: reward up, KL in the band, entropy and diversity steady, groups informative."""
    return {
        "reward/mean": 0.3 + 0.01 * step,
        "kl/ref": 0.05 + 0.001 * step,
        "learner/entropy": 0.8 - 0.002 * step,
        "response/length_mean": 20.0 + 0.05 * step,
        "response/distinct_2": 0.6,
        "reward/zero_spread_groups": 0.2,
        "loss/value": 0.5 - 0.005 * step,
        "rollout/logprob_gap": 0.01,
    }


def run(stream, before=None, cfg=None) -> tuple[list[str], Health, list[dict]]:
    said: list[str] = []
    health = Health(cfg or HealthConfig(), said.append)
    health.before = before or {}
    counts = [health.observe(step, metrics) for step, metrics in enumerate(stream, 1)]
    return said, health, counts


def pushed(key: str, value, after: int = 20):
    """The healthy stream with `key` set by value(step) from step `after` on."""
    return [healthy(s) | ({key: value(s)} if s >= after else {}) for s in range(1, STEPS + 1)]


def test_a_healthy_run_says_nothing():
    said, _, counts = run([healthy(s) for s in range(1, STEPS + 1)], {"eval/greedy/reward/accuracy": 0.3})
    assert said == [] and all(v == 0 for v in counts[-1].values())
    assert set(counts[-1]) == {f"health/{s.name}" for s in SIGNS}


STREAMS = {
    "kl_band": (pushed("kl/ref", lambda s: 0.002, after=1), "algorithm.init_kl_coef"),
    "entropy_collapse": (pushed("learner/entropy", lambda s: 0.05), "algorithm.entropy_coef"),
    "length_hacking": (
        [healthy(s) | {"reward/mean": 0.5, "response/length_mean": 20.0 * 1.07**s} for s in range(1, STEPS + 1)],
        "length_penalty",
    ),
    "diversity_collapse": (pushed("response/distinct_2", lambda s: 0.2), "algorithm.init_kl_coef"),
    "no_signal_groups": (pushed("reward/zero_spread_groups", lambda s: 0.8), "data.dynamic_sampling"),
    "value_loss_explosion": (pushed("loss/value", lambda s: 50.0, after=30), "learner.critic_lr"),
    "logprob_gap": (pushed("rollout/logprob_gap", lambda s: 0.2), "async_training.max_staleness"),
}


@pytest.mark.parametrize("sign", sorted(STREAMS))
def test_each_sign_fires_once_on_a_stream_that_shows_it_naming_the_knob(sign):
    stream, knob = STREAMS[sign]
    said, _, counts = run(stream)
    assert len(said) == 1 and f": {sign}: " in said[0] and knob in said[0], said
    assert counts[-1][f"health/{sign}"] == 1 and sum(counts[-1].values()) == 1


def test_length_hacking_needs_a_whole_window_and_a_flat_reward():
    rising = [healthy(s) | {"reward/mean": 0.5, "response/length_mean": 20.0 * 1.3**s} for s in range(1, STEPS + 1)]
    said, _, _ = run(rising)
    assert len(said) == 1 and "step 10:" in said[0]  # not at step 4 on 4 steps' trend
    falling = [r | {"reward/mean": 0.9 - 0.02 * s} for s, r in enumerate(rising, 1)]
    assert run(falling)[0] == []  # the reward falls: not a reward that pays for length


def test_the_kl_band_waits_for_the_first_window_and_warns_above_it_too():
    said, _, _ = run(pushed("kl/ref", lambda s: 0.002, after=1)[:14])  # 10 steps of baseline, 4 under: not yet
    assert said == []
    said, _, _ = run(pushed("kl/ref", lambda s: 3.0, after=1))
    assert len(said) == 1 and "over 1.0" in said[0] and "step 5:" in said[0]  # a drift needs no warm-up


def test_reward_hacking_needs_training_reward_up_and_held_out_down():
    stream = [healthy(s) for s in range(1, STEPS + 1)]  # training reward rises 0.3 -> 0.7
    stream[29]["eval/greedy/reward/accuracy"] = 0.80  # held out fell from 0.91
    said, _, counts = run(stream, {"eval/greedy/reward/accuracy": 0.91})
    assert len(said) == 1 and "reward_hacking" in said[0] and "0.910 -> 0.800" in said[0] and "step 30" in said[0]
    assert counts[-1]["health/reward_hacking"] == 1  # stays on through the later steps: said once
    stream[29]["eval/greedy/reward/accuracy"] = 0.92  # held out up too: learning, not hacking
    assert run(stream, {"eval/greedy/reward/accuracy": 0.91})[0] == []


def test_reward_hacking_is_checked_on_the_final_evaluation_of_a_run_that_evaluates_only_then():
    said, health, _ = run([healthy(s) for s in range(1, 16)], {"eval/greedy/reward/accuracy": 0.91})
    assert said == []  # no held-out figure during training
    counts = health.final(15, {"eval/greedy/reward/accuracy": 0.78, "eval/sampled/kl_ref": 0.1})
    assert len(said) == 1 and "reward_hacking" in said[0] and "0.910 -> 0.780" in said[0]
    assert counts["health/reward_hacking"] == 1 and sum(counts.values()) == 1


def test_a_sign_that_clears_and_comes_back_is_counted_again():
    stream = pushed("reward/zero_spread_groups", lambda s: 0.8 if s < 28 or s >= 33 else 0.1)
    said, _, counts = run(stream)
    assert len(said) == 2 and counts[-1]["health/no_signal_groups"] == 2


def test_value_loss_that_is_not_finite_fires_and_runs_without_a_critic_stay_silent():
    for bad in (math.nan, math.inf):
        said, _, _ = run(pushed("loss/value", lambda s: bad, after=30))
        assert len(said) == 1 and "value_loss_explosion" in said[0] and "step 30" in said[0]
    no_critic = [{k: v for k, v in healthy(s).items() if k != "loss/value"} for s in range(1, STEPS + 1)]
    assert run(no_critic)[0] == []


def test_health_resumes_from_its_state_as_if_never_stopped():
    stream = pushed("learner/entropy", lambda s: 0.05)
    whole, _, whole_counts = run(stream)
    said, first, _ = run(stream[:22])
    state = json.loads(json.dumps(first.state_dict()))
    resumed = Health(HealthConfig(), said.append)
    resumed.load_state_dict(state)
    counts = [resumed.observe(step, m) for step, m in enumerate(stream[22:], 23)]
    assert said == whole and counts[-1] == whole_counts[-1]
    fresh = Health(HealthConfig(), said.append)
    fresh.load_state_dict(None)  # a checkpoint from before health: starts afresh
    assert fresh.recent == [] and fresh.counts == {s.name: 0 for s in SIGNS}


def test_disabled_health_says_and_counts_nothing():
    said, _, counts = run(STREAMS["entropy_collapse"][0], cfg=HealthConfig(enabled=False))
    assert said == [] and counts[-1] == {}


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("health.window=0", "health.window"),
        ("health.patience=11", "health.patience"),
        ("health.patience=0", "health.patience"),
        ("health.kl_low=2.0", "health.kl_low"),
        ("health.entropy_floor=0", "health.entropy_floor"),
        ("health.value_loss_factor=-1", "health.value_loss_factor"),
    ],
)
def test_bad_thresholds_are_named_before_the_run_starts(override, key):
    with pytest.raises(Exception, match=key.replace(".", r"\.")):
        load_config(DEFAULT, [override])


def test_the_signs_that_apply_follow_the_estimator_the_samples_and_the_mode():
    assert applicable(load_config(DEFAULT, [])) == {s.name for s in SIGNS}  # GRPO, 8 samples, sync
    ppo = applicable(load_config(DEFAULT, ["algorithm.estimator=gae", "learner.value_head=separate"]))
    assert "no_signal_groups" not in ppo  # a critic's advantage needs no spread within a group
    assert "no_signal_groups" not in applicable(load_config(DEFAULT, ["rollout.sampling.n_samples_per_prompt=2"]))
    assert "no_signal_groups" not in applicable(load_config(DEFAULT, ["data.dynamic_sampling=true"]))
    assert "logprob_gap" not in applicable(load_config(DEFAULT, ["async_training.mode=one_step"]))
    said: list[str] = []
    health = Health(HealthConfig(), said.append, applicable(load_config(DEFAULT, ["data.dynamic_sampling=true"])))
    for step, metrics in enumerate(STREAMS["no_signal_groups"][0], 1):
        health.observe(step, metrics)
    assert said == []


def test_a_held_out_drop_within_the_evaluations_noise_is_not_hacking():
    stream = [healthy(s) for s in range(1, STEPS + 1)]
    before = {"eval/greedy/reward/accuracy": 0.85, "eval/prompts": 32.0}  # noise 2 sqrt(.85 x .15 / 32) = 0.13
    stream[29]["eval/greedy/reward/accuracy"] = 0.78
    assert run(stream, before)[0] == []
    stream[29]["eval/greedy/reward/accuracy"] = 0.70
    assert len(run(stream, before)[0]) == 1

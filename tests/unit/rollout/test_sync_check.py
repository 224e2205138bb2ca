"""The sync check's arithmetic (rollout/sync_check.py), by hand; the real engines and learner:
tests/e2e/learner/test_learner_sync.py."""

from types import SimpleNamespace

import pytest

from rollout.config import RolloutConfig
from rollout.sync_check import TOLERANCE, SyncCheck, SyncCheckFailed, check, largest_gap, prompt_logprobs


def test_the_prompt_logprob_of_each_probe_token_after_the_first():
    lp = SimpleNamespace
    out = SimpleNamespace(prompt_logprobs=[None, {7: lp(logprob=-1.5), 2: lp(logprob=-0.1)}, {9: lp(logprob=-3.0)}])
    assert prompt_logprobs(out, [5, 7, 9]) == [-1.5, -3.0]  # the probe's own token, not the top one


def test_the_largest_gap_over_tokens_and_engines_names_its_engine():
    learner = [-1.0, -2.0, -3.0]
    assert largest_gap(learner, [[-1.0, -2.0, -3.0], [-1.0, -2.5, -2.9]]) == (pytest.approx(0.5), 1)
    assert check(learner, [[-1.0, -2.0, -3.0004]], 4, "full weights, float32", 1e-3) == pytest.approx(4e-4)
    with pytest.raises(SyncCheckFailed, match=r"version 4 \(p\): engine 1 scores the probe 0.5 nats .*tolerance 0.001"):
        check(learner, [learner, [-1.0, -2.5, -3.0]], 4, "p", 1e-3)
    with pytest.raises(SyncCheckFailed, match="nan nats"):  # a NaN logprob fails, not passes
        check(learner, [[-1.0, float("nan"), -3.0]], 4, "p", 1e-3)
    with pytest.raises(ValueError):  # a probe scored to another length is an error, not a short comparison
        largest_gap(learner, [[-1.0, -2.0]])


def test_the_check_follows_the_config():
    assert SyncCheck.of(RolloutConfig(sync_check=False)) is None
    assert SyncCheck.of(RolloutConfig()) == SyncCheck("full weights, float32", TOLERANCE["float32"])
    bf16 = SyncCheck.of(RolloutConfig(dtype="bfloat16"), lora="merged")
    assert bf16 == SyncCheck("merged LoRA weights, bfloat16", TOLERANCE["bfloat16"])
    assert SyncCheck.of(RolloutConfig(), lora="adapter") == SyncCheck("LoRA adapter, float32", TOLERANCE["float32"])
    assert SyncCheck.of(RolloutConfig(sync_check_tolerance=0.01)).tolerance == 0.01

"""algorithm.off_policy.correction: auto (the default) resolved at launch: tis in an asynchronous mode (measured
to close in_flight's gap to sync, docs/benchmarks.md), none in sync; `none` asked by name stays, said."""

import pytest

from learner.config import OffPolicyKind
from orchestrator.config.load import load_config
from tests.helpers import REPO

DEFAULT = REPO / "configs" / "grpo_tiny_cpu.yaml"


def loaded(*overrides):
    lines = []
    cfg = load_config(DEFAULT, list(overrides), dtype_lines=lines)
    return cfg.algorithm.off_policy.correction, [line for line in lines if "off_policy" in line]


def test_sync_stays_uncorrected_and_says_nothing():
    assert loaded() == (OffPolicyKind.none, [])


@pytest.mark.parametrize(
    ("mode", "behind"), [("one_step", "1 version"), ("full", "3 versions"), ("in_flight", "3 versions")]
)
def test_an_asynchronous_mode_takes_tis_and_says_so(mode, behind):
    correction, lines = loaded(f"async_training.mode={mode}", "async_training.max_staleness=3")
    assert correction == OffPolicyKind.tis
    assert lines == [
        f"algorithm.off_policy.correction auto -> tis (async_training.mode {mode}: samples from engines up to "
        f"{behind} behind the learner)"
    ]


def test_none_asked_by_name_stays_and_is_said_another_correction_stays_quietly():
    correction, lines = loaded("async_training.mode=in_flight", "algorithm.off_policy.correction=none")
    assert correction == OffPolicyKind.none and "none, as asked" in lines[0] and "learn less" in lines[0]
    assert loaded("async_training.mode=one_step", "algorithm.off_policy.correction=icepop") == (
        OffPolicyKind.icepop,
        [],
    )


def test_a_config_built_in_code_is_resolved_when_the_run_starts_and_a_bare_learner_reads_auto_as_none():
    from learner.config import OffPolicyConfig
    from orchestrator.config.correction import resolve_corrections

    cfg = load_config(DEFAULT, ["async_training.mode=one_step"])
    cfg.algorithm.off_policy.correction = OffPolicyKind.auto  # as a TrainConfig made in code has it
    resolve_corrections(cfg)  # what start_parts does before any role starts
    assert cfg.algorithm.off_policy.correction == OffPolicyKind.tis
    assert OffPolicyConfig().kind == "none" and OffPolicyConfig(correction=OffPolicyKind.tis).kind == "tis"

"""cluster.rollout_workers as a range (an elastic rollout pool): parsing, the rules that refuse a range where
no node's arrival decides where engines go, the bundles it leaves out, the plan's line, and the counts a
restore keeps (rollout/members.py and tests/unit/rollout/test_members.py: the pool's side)."""

import pytest

from orchestrator.config.load import ConfigError, load_config
from orchestrator.config.schema import ClusterConfig, engine_range
from orchestrator.loop.loop_state import restored_counters
from orchestrator.loop.placement import bundles
from orchestrator.loop.step_metrics import busy_metrics
from tests.helpers import REPO

DEFAULT = REPO / "configs" / "grpo_tiny_cpu.yaml"
RANGE = ["cluster.rollout_workers=1..3", "cluster.rollout_resource=rollout_node"]


def test_a_number_or_a_range_of_engines():
    assert engine_range(2) == (2, 2) and engine_range("2") == (2, 2) and engine_range(" 1..3 ") == (1, 3)
    for bad in ("1-3", "a..b", "1..", "..2", "1..2..3"):
        with pytest.raises(ValueError, match="min..max"):
            engine_range(bad)
    c = ClusterConfig(rollout_workers="2..4")
    assert (c.engines, c.max_engines, c.elastic) == (2, 4, True)
    assert not ClusterConfig(rollout_workers=3).elastic and ClusterConfig(rollout_workers="3..3").engines == 3


def test_a_range_loads_from_the_command_line_and_from_a_file(tmp_path):
    cfg = load_config(DEFAULT, RANGE)
    assert (cfg.cluster.engines, cfg.cluster.max_engines, cfg.cluster.elastic) == (1, 3, True)
    text = DEFAULT.read_text().replace("rollout_workers: 1", 'rollout_workers: "2..3"\n  rollout_resource: r')
    (tmp_path / "c.yaml").write_text(text)
    assert load_config(tmp_path / "c.yaml").cluster.max_engines == 3


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["cluster.rollout_workers=1-3"], "a range \"min..max\", got '1-3'"),
        (["cluster.rollout_workers=0"], "must be >= 1"),
        (["cluster.rollout_workers=3..1", "cluster.rollout_resource=r"], "1 <= min <= max"),
        (["cluster.rollout_workers=1..2"], "set cluster.rollout_resource"),  # colocated CPU actors reserve nothing
        (
            [*RANGE, "cluster.gpus_per_rollout_worker=1", "cluster.gpus_per_learner=1"],
            "colocated on the learner's GPUs stay fixed",
        ),
        ([*RANGE, "rollout.endpoint.enabled=true"], "the agent endpoint serves a fixed set"),
    ],
)
def test_a_range_is_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match="cluster.rollout_workers") as e:
        load_config(DEFAULT, overrides)
    assert message in str(e.value)


def test_an_elastic_pools_engines_are_in_no_bundle():
    """colocate false: the fixed engines' bundles are the group's; an elastic pool's ask the cluster themselves."""
    fixed = ClusterConfig(rollout_workers=2, colocate=False, rollout_resource="rollout_node")
    elastic = ClusterConfig(rollout_workers="2..4", colocate=False, rollout_resource="rollout_node")
    assert bundles(fixed) == [{"CPU": 1, "rollout_node": 1}] * 2 + [{"CPU": 1}, {"CPU": 1}]
    assert bundles(elastic) == [{"CPU": 1}, {"CPU": 1}]  # the learner rank and the scoring service
    assert load_config(DEFAULT, ["cluster.rollout_workers=1..2", "cluster.colocate=false"]).cluster.elastic


def test_busy_shares_follow_each_engine_by_id_when_members_change():
    """An engine that left is not in the step's end; one that joined counts from its start."""
    timings = {"timing/total": 10.0, "timing/advantages": 1.0, "timing/update": 2.0}
    before = {"rollout": {"a": 100.0, "b": 50.0}, "scoring": {"scoring": 0.0}}
    after = {"rollout": {"a": 104.0, "c": 8.0}, "scoring": {"scoring": 5.0}}  # b left, c joined
    m = busy_metrics(timings, before, after)
    assert m["pipeline/busy/rollout"] == pytest.approx((4.0 + 8.0) / 2 / 10.0)
    assert m["pipeline/busy/scoring"] == pytest.approx(0.5) and m["pipeline/busy/learner"] == pytest.approx(0.3)


def test_a_learner_recovery_keeps_the_engines_that_joined_and_left_a_resume_takes_the_checkpoints():
    now = {"rollout/engines_joined": 2, "rollout/engines_left": 1, "restarts/relaunched_batches": 3, "data/x": 9}
    saved = {"rollout/engines_joined": 1, "rollout/engines_left": 0, "restarts/relaunched_batches": 0, "data/x": 4}
    assert restored_counters(now, saved, in_process=True) == now | {"data/x": 4}
    assert restored_counters(now, saved, in_process=False) == saved
    older = {"data/x": 4}  # a checkpoint from before elastic pools: the counts go on from the current ones
    assert restored_counters(now, older, in_process=False)["rollout/engines_joined"] == 2


def test_relay_plan_shows_the_range(capsys):
    from orchestrator.cli import main

    assert main(["plan", str(REPO / "configs/ppo_llama-8b_multinode_gpu.yaml"), "cluster.rollout_workers=4..7"]) == 0
    assert "rollout worker (x4..7, elastic, per device)" in capsys.readouterr().out


def test_fewer_engines_than_the_min_ends_the_run_resumable(tmp_path):
    from orchestrator.loop.endings import ending
    from rollout.members import EnginesLost

    status, line = ending(EnginesLost("0 rollout engine(s) remain, fewer than ..."), tmp_path, "relay train C")
    assert status == 3 and "relay: run ended: EnginesLost" in line and "relay train C" in line

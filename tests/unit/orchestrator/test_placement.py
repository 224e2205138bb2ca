"""The placement knobs reach the bundles and the actor options (what tests/e2e/deploy/test_multinode.py
runs on two nodes)."""

from learner.group import rank_options
from orchestrator.config.schema import ClusterConfig
from orchestrator.loop.placement import bundles, one_unit_of
from runtime.actors import actor_options


def test_placement_knobs_reach_bundles_and_actor_options():
    c = ClusterConfig(
        rollout_workers=2,
        learner_ranks=1,
        colocate=False,
        gpus_per_learner=1.0,
        rollout_resource="rollout_node",
        learner_resource="learner_node",
    )
    assert bundles(c) == [
        {"CPU": 1, "rollout_node": 1},
        {"CPU": 1, "rollout_node": 1},
        {"CPU": 1, "GPU": 1.0, "learner_node": 1},
        {"CPU": 1},
    ]
    assert bundles(ClusterConfig(colocate=False)) == [{"CPU": 1}, {"CPU": 1}, {"CPU": 1}]
    assert one_unit_of("") == {} and one_unit_of("scoring_node") == {"scoring_node": 1}
    assert actor_options(0, 0, 2, {}, one_unit_of("rollout_node"))["resources"] == {"rollout_node": 1}
    assert actor_options(0, 0, 2, {})["resources"] == {}
    assert rank_options(0, 0, 1, one_unit_of("learner_node"))["resources"] == {"learner_node": 1}

"""The unit tier holds no Ray: starting Ray here fails loudly (tests/unit/conftest.py), also when a Ray
call would start a cluster on first use; and the folder, not a marker, puts a test in its tier."""

import pytest
import ray


def test_ray_init_fails_in_the_unit_tier():
    with pytest.raises(RuntimeError, match="belongs under tests/e2e"):
        ray.init(num_cpus=1)


def test_a_ray_call_that_would_start_a_cluster_fails_too():
    assert not ray.is_initialized()
    with pytest.raises(RuntimeError, match="belongs under tests/e2e"):
        ray.get([])  # what orchestrator.loop.profiling.profiled did in the fast tier before the tiers


def test_a_unit_test_carries_no_tier_marker(request):
    assert request.node.get_closest_marker("e2e") is None and request.node.get_closest_marker("gpu") is None


def test_no_two_test_files_share_a_name():
    """`pytest -q` collects every tier in one session, in which two test modules of one name (rootdir-based
    imports, no packages) fail to collect with "import file mismatch"."""
    from collections import Counter

    from tests.helpers import REPO

    names = Counter(p.name for p in (REPO / "tests").rglob("test_*.py"))
    assert not [n for n, count in names.items() if count > 1]

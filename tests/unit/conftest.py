"""The unit tier runs without Ray: ray.init (which Ray's own calls reach too, when they start a cluster
on first use) fails at once here, so a test that needs Ray cannot slip into this tier."""

import pytest


def ray_is_not_for_unit_tests(*args, **kwargs):
    raise RuntimeError("ray.init in tests/unit: a test that needs Ray belongs under tests/e2e")


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "init", ray_is_not_for_unit_tests)  # per test: `pytest -q` runs e2e tests after these

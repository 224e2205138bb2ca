"""Fixtures of the orchestrator's unit tests."""

import pytest

from tests.unit.orchestrator.test_tracking import FakeWandb


@pytest.fixture
def fake_wandb(monkeypatch):
    """wandb.init's step rules without wandb (test_tracking.FakeWandb)."""
    import wandb

    fake = FakeWandb()
    monkeypatch.setattr(wandb, "init", fake.init)
    monkeypatch.setattr(wandb, "Table", lambda columns, data: ("table", columns, data))
    monkeypatch.setattr(wandb, "Image", lambda path: ("image", path))
    return fake

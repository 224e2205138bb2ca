"""The loop's side of an incident folder (runtime/watchdog.py writes the stacks, `ray status` and this)."""

from __future__ import annotations

from collections.abc import Callable

from orchestrator.config.load import to_dict
from orchestrator.config.schema import TrainConfig


class IncidentContext:
    """What the watchdog needs of the loop: every role's actor by name (none while the roles start), and
    for the incident folder the step, the last step's metrics and the config."""

    def __init__(self, cfg: TrainConfig, step: Callable[[], int]):
        self.cfg, self.step = cfg, step
        self.roles, self.last_metrics = None, {}

    def actors(self) -> dict:
        return self.roles.actors() if self.roles is not None else {}

    def __call__(self) -> dict:
        return {"step": self.step(), "last_metrics": self.last_metrics, "config": to_dict(self.cfg)}

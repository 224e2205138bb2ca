"""KL coefficient controllers: the one piece of RL state beside the weights, checkpointed with the
learner (learner/checkpoint.py) so an adaptive coefficient survives resume. The KL they are fed is
computed by learner/algorithms.py (`sequence_kl`)."""

from __future__ import annotations

import math


class FixedKLController:
    """A KL coefficient that never moves (kl_controller: fixed); checkpointed like the adaptive one."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Ziegler et al. 2019: move the coefficient towards `target` KL, proportionally, error clipped
    to +-20%, at a rate of n_steps / horizon per update. Its value is checkpointed with the run.

    The KL is per sequence (`sequence_kl`: summed over a response's tokens, averaged over samples),
    the unit of Ziegler et al.'s and TRL's targets (6.0 in their sentiment runs)."""

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        self.value, self.target, self.horizon = float(init_kl_coef), float(target), int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        if not math.isfinite(current_kl):
            return  # a broken measurement must not wreck the coefficient
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)  # current_kl: `sequence_kl`
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        self.value, self.target, self.horizon = float(state["value"]), float(state["target"]), int(state["horizon"])

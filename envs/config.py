"""Config section owned by envs/: which environment the rollouts play, and its limits."""

from dataclasses import dataclass, field
from typing import Any


@dataclass
class EnvConfig:
    """The `env` section: which environment episodes play, and its limits per turn and episode."""

    name: str = ""
    """"" = single-turn (prompt -> one response); a built-in (calculator, guess_number) or "module.path:Class" """
    max_turns: int = 4
    """model turns per episode; the episode ends after this many, reward as the environment left it"""
    max_episode_tokens: int = 0
    """model + observation tokens after the prompt; 0 = max_turns * rollout.sampling.max_new_tokens"""
    step_timeout_s: float = 10.0
    """seconds one reset or step may take, else that episode ends, counted under env/timeouts"""
    observation_role: str = "user"
    """chat role of observations (e.g. "tool" where the model's chat template has one)"""
    options: dict[str, Any] = field(default_factory=dict)
    """keyword arguments of the environment's constructor"""

    def response_tokens(self, max_new_tokens: int) -> int:
        """The most tokens a sample holds after its prompt: one response without an environment, else
        the episode's budget (its model and observation tokens)."""
        if not self.name:
            return max_new_tokens
        return self.max_episode_tokens or self.max_turns * max_new_tokens

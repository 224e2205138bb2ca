"""What reward_service/ returns: the scores of one rollout batch."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ScoredBatch:
    """Aligned with the RolloutBatch it scores (B samples)."""

    rewards: list[float]  # (B,) combined, clipped and normalised; 0 for invalid samples
    components: dict[str, list[float]]  # source name -> (B,) raw score, nan where that source failed
    valid: list[bool]  # (B,) False: drop the sample from the update (invalid: drop)
    invalid: list[bool]  # (B,) some source could not score the sample
    ref_logprobs: list[list[float]]  # (B, ragged) reference-policy logprob of each response token
    metrics: dict[str, float] = field(default_factory=dict)  # reward/*: means, invalid_frac, timeouts

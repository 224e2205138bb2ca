"""What reward_service/ returns: the scores of one rollout batch."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ScoredBatch:
    """Aligned with the RolloutBatch it scores (B samples)."""

    rewards: list[float]  # (B,) what trains: raw + overlong penalty, clipped and normalised; 0 for invalid samples
    components: dict[str, list[float]]  # source name -> (B,) raw score, nan where that source failed
    valid: list[bool]  # (B,) False: out of the loss and the group baselines (invalid: drop, the default)
    invalid: list[bool]  # (B,) a source that trains could not judge the sample (a failure, not a score)
    ref_logprobs: list[list[float]]  # (B, ragged) reference-policy logprob of each response token
    metrics: dict[str, float] = field(default_factory=dict)  # reward/*: means, invalid_frac, timeouts
    # (B,) the sources' weighted sum before any shaping (overlong, clip, normalisation), nan where
    # invalid: what reward/mean reports. Left empty, it is `rewards` (a batch built unshaped)
    raw: list[float] = field(default_factory=list)

    def __post_init__(self):
        if not self.raw:
            self.raw = [float("nan") if bad else r for r, bad in zip(self.rewards, self.invalid)]

    def select(self, rows: list[int]) -> ScoredBatch:
        pick = lambda xs: [xs[i] for i in rows]  # noqa: E731
        return ScoredBatch(pick(self.rewards), {k: pick(v) for k, v in self.components.items()}, pick(self.valid),
                           pick(self.invalid), pick(self.ref_logprobs), dict(self.metrics), pick(self.raw))

    @staticmethod
    def concat(parts: list[ScoredBatch]) -> ScoredBatch:
        """Join in order; metrics are those of the first part."""
        out = ScoredBatch([], {k: [] for k in parts[0].components}, [], [], [], dict(parts[0].metrics))
        for p in parts:
            out.rewards += p.rewards
            out.valid += p.valid
            out.invalid += p.invalid
            out.ref_logprobs += p.ref_logprobs
            out.raw += p.raw
            for k, v in p.components.items():
                out.components[k] += v
        return out

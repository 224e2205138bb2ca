"""What reward_service/ returns: the scores of one rollout batch."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ScoredBatch:
    """Aligned with the RolloutBatch it scores (B samples)."""

    rewards: list[float]  # (B,) what trains: raw + overlong penalty, clipped and normalised (see reward.invalid)
    components: dict[str, list[float]]  # source name -> (B,) raw score, nan where that source failed
    valid: list[bool]  # (B,) False: out of the loss and the group baselines (invalid: drop, the default)
    invalid: list[bool]  # (B,) a source that trains could not judge the sample (a failure, not a score)
    ref_logprobs: list[list[float]]  # (B, ragged) reference-policy logprob of each response token
    # (B,) the sources' weighted sum before any shaping (overlong, clip, normalisation), nan where
    # invalid: what reward/mean reports. Required: a default would pass shaped rewards off as raw
    raw: list[float] = field(kw_only=True)
    # (B,) under reward.normalization: batch, `rewards` before the normalisation (0 where left out);
    # None otherwise. A batch joined from several calls' samples (dynamic sampling) is normalised
    # again over its own samples with it (shaping.renormalised), never by each call's statistics
    unnormalised: list[float] | None = field(default=None, kw_only=True)
    # the scoring calls' own counts (reward/timeouts, reward/errors, reward/retried_attempts) and each
    # failing source's first error: of the calls, so a selection of samples carries none of them
    metrics: dict[str, float] = field(default_factory=dict, kw_only=True)
    errors: dict[str, str] = field(default_factory=dict, kw_only=True)

    def __post_init__(self):
        if len(self.raw) != len(self.rewards):
            raise ValueError(f"raw has {len(self.raw)} entries for {len(self.rewards)} rewards")
        if self.unnormalised is not None and len(self.unnormalised) != len(self.rewards):
            raise ValueError(f"unnormalised has {len(self.unnormalised)} entries for {len(self.rewards)} rewards")

    def select(self, rows: list[int]) -> ScoredBatch:
        """The samples `rows`, without the calls' counts (which belong to the whole calls)."""
        pick = lambda xs: [xs[i] for i in rows]  # noqa: E731
        return ScoredBatch(
            pick(self.rewards),
            {k: pick(v) for k, v in self.components.items()},
            pick(self.valid),
            pick(self.invalid),
            pick(self.ref_logprobs),
            raw=pick(self.raw),
            unnormalised=None if self.unnormalised is None else pick(self.unnormalised),
        )

    @staticmethod
    def concat(parts: list[ScoredBatch], calls: list[ScoredBatch] | None = None) -> ScoredBatch:
        """Join in order, with the counts and first errors of `calls` (default: the parts) summed
        (call_totals): the scoring calls the parts were selected from, e.g. every dynamic-sampling round."""
        metrics, errors = call_totals(parts if calls is None else calls)
        out = ScoredBatch([], {k: [] for k in parts[0].components}, [], [], [], raw=[], metrics=metrics, errors=errors)
        out.unnormalised = [] if all(p.unnormalised is not None for p in parts) else None
        for p in parts:
            out.rewards += p.rewards
            out.valid += p.valid
            out.invalid += p.invalid
            out.ref_logprobs += p.ref_logprobs
            out.raw += p.raw
            if out.unnormalised is not None:
                out.unnormalised += p.unnormalised
            for k, v in p.components.items():
                out.components[k] += v
        return out


def call_totals(parts: list[ScoredBatch]) -> tuple[dict[str, float], dict[str, str]]:
    """The counts of several scoring calls summed, and each source's first error among them."""
    metrics: dict[str, float] = {}
    errors: dict[str, str] = {}
    for p in parts:
        for k, v in p.metrics.items():
            metrics[k] = metrics.get(k, 0.0) + v
        for k, v in p.errors.items():
            errors.setdefault(k, v)
    return metrics, errors

"""Reward shaping after combination: clipping, then batch or running normalisation.

Normalisation uses the samples that train only; those left out (invalid under reward.invalid: drop)
stay at 0, masked out of the loss anyway. The running normaliser's state is
part of the run's checkpoint, so a resumed run normalises exactly as the uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import math

from reward_service.config import Normalization
from reward_service.types import ScoredBatch


class RunningMeanStd:
    """Mean and variance over every reward seen so far (Chan et al.'s parallel update)."""

    def __init__(self):
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    def update(self, values: list[float]) -> None:
        if not values:
            return
        n = len(values)
        mean = sum(values) / n
        m2 = sum((v - mean) ** 2 for v in values)
        delta, total = mean - self.mean, self.count + n
        self.mean += delta * n / total
        self.m2 += m2 + delta**2 * self.count * n / total
        self.count = total

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / (self.count - 1)) if self.count > 1 else 1.0

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.mean, self.m2 = int(state["count"]), float(state["mean"]), float(state["m2"])


def overlong_penalty(lengths: list[int], max_tokens: int, buffer: int, factor: float = 1.0) -> list[float]:
    """DAPO's soft overlong punishment (Yu et al. 2025): 0 up to max_tokens - buffer tokens, then
    falling linearly to -factor at max_tokens, and -factor beyond. Added to the reward, it tells a
    response cut at the length limit from one that ended, without punishing long reasoning abruptly."""
    start = max_tokens - buffer
    return [0.0 if n <= start else -factor * min(n - start, buffer) / buffer for n in lengths]


def shape(
    rewards: list[float],
    left_out: list[bool],
    clip: float,
    normalization: Normalization,
    running: RunningMeanStd,
    eps: float = 1e-8,
) -> list[float]:
    """Clip to [-clip, clip] (0 = off), then normalise over the samples not `left_out`; those -> 0."""
    out = clipped(rewards, clip)
    if normalization == Normalization.batch:
        return whitened(out, left_out, eps)
    if normalization == Normalization.running:
        running.update([r for r, bad in zip(out, left_out) if not bad])
        out = [(r - running.mean) / (running.std + eps) for r in out]
    return [0.0 if bad else r for r, bad in zip(out, left_out)]


def clipped(rewards: list[float], clip: float) -> list[float]:
    """Each reward clipped to [-clip, clip]; 0 = off."""
    return [min(max(r, -clip), clip) if clip > 0 else r for r in rewards]


def whitened(rewards: list[float], left_out: list[bool], eps: float = 1e-8) -> list[float]:
    """Batch normalisation: minus the mean, over the unbiased std, of the samples not `left_out`; those -> 0."""
    good = [r for r, bad in zip(rewards, left_out) if not bad]
    if not good:
        return [0.0] * len(rewards)
    mean = sum(good) / len(good)
    std = math.sqrt(sum((r - mean) ** 2 for r in good) / (len(good) - 1)) if len(good) > 1 else 1.0
    return [0.0 if bad else (r - mean) / (std + eps) for r, bad in zip(rewards, left_out)]


def renormalised(scored: ScoredBatch) -> ScoredBatch:
    """`scored` with its rewards batch-normalised over its own samples, where they were batch-normalised
    (ScoredBatch.unnormalised): a batch of groups kept from several calls (dynamic sampling) gets one
    mean and std, as one call would have given it. Each call's own would reweigh the groups for the
    estimators that divide by no group std (RLOO, Dr. GRPO, reinforce_baseline)."""
    if scored.unnormalised is None:
        return scored
    return dataclasses.replace(scored, rewards=whitened(scored.unnormalised, [not v for v in scored.valid]))

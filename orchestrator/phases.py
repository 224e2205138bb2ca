"""Per-step helpers of the loop that are not algorithm math: batch statistics, a phase timer."""
from __future__ import annotations

import statistics
import time
from contextlib import contextmanager

from reward_service.types import ScoredBatch
from rollout.types import RolloutBatch


@contextmanager
def timed(timings: dict[str, float], name: str):
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[f"timing/{name}"] = time.perf_counter() - start


def quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def batch_metrics(batch: RolloutBatch, scored: ScoredBatch, prefix: str = "") -> dict[str, float]:
    """What a practitioner watches for reward hacking, collapse and instability, from one batch."""
    r = scored.rewards
    lengths = batch.response_lengths
    m = {
        "reward/mean": statistics.fmean(r), "reward/std": statistics.pstdev(r), "reward/min": min(r), "reward/max": max(r),
        "reward/p10": quantile(r, 0.1), "reward/p50": quantile(r, 0.5), "reward/p90": quantile(r, 0.9),
        "response/length_mean": statistics.fmean(lengths), "response/length_max": float(max(lengths)),
        "response/clipped_frac": sum(f == "length" for f in batch.finish_reason) / len(batch),
        "rollout/skipped_prompts": float(len(batch.skipped)),
    }
    for name, scores in scored.components.items():
        good = [s for s in scores if s == s]  # not NaN
        if name.startswith(("math_answer", "exact_match", "reasoning_gym")) and good:
            m.setdefault("reward/accuracy", statistics.fmean(good))
    m.update(scored.metrics)
    return {prefix + k: v for k, v in m.items()}


def prompt_text(prompt) -> str:
    """A prompt for display: chat messages as their last message's content."""
    return prompt[-1]["content"] if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict) else str(prompt)


def offset(batch: RolloutBatch, by: int) -> RolloutBatch:
    """The same batch with prompt indices shifted (for batches generated in top-up rounds)."""
    batch.prompt_index = [i + by for i in batch.prompt_index]
    batch.skipped = [(i + by, why) for i, why in batch.skipped]
    return batch

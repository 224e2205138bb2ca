"""The sync check: after every weight sync, each engine's logprobs of a fixed token sequence (the probe) must
be the learner's, within the dtype's tolerance. A sync that loaded nothing, loaded stale or wrongly cast
weights, or lost an adapter, fails the run at that sync, naming the policy version, the path and the gap,
instead of looking like staleness many steps later.

The engine scores the probe as a prompt (vLLM's prompt logprobs: the raw distribution, temperature 1, read
past the prefix cache); the learner computes the same with its policy (Learner.probe_logprobs) before the
weights leave it, so a background sync is checked against the version it sent."""

from __future__ import annotations

import math
from dataclasses import dataclass

PROBE_TEXT = "relay checks every weight sync: 12+34=46, 7*8=56; the quick brown fox jumps over the lazy dog."
PROBE_TOKENS = 32  # the probe's length at most; a forward of this many tokens per sync on each side
# the largest gap (nats, any probe token, any engine) a sync that arrived may show, by dtype (docs/benchmarks.md
# "Sync check", 2 CPU cores): float32 measured 6e-6 (tiny GPT) and 3e-5 (SmolLM2-135M) after a sync, against
# 0.11 and 0.28 with the engine one update stale; bf16 engines and an autocast learner round apart by up to 0.26
# on SmolLM2, as much as one small update moves it, so in bf16 the check catches a sync that lost many updates or
# the wrong weights, not one that lost a single small update; float16 (3 more mantissa bits) is not measured
TOLERANCE = {"float32": 1e-3, "bfloat16": 0.75, "float16": 0.1}


@dataclass(frozen=True)
class SyncCheck:
    """What a channel checks its syncs with: the path the weights take (named in a failure) and the tolerance."""

    path: str
    tolerance: float

    @staticmethod
    def of(rollout_cfg, lora: str = "") -> SyncCheck | None:
        """rollout.sync_check's check for a run in rollout.dtype; lora: what a LoRA run's syncs send (learner.lora.sync,
        "adapter" or "merged"; "" without LoRA); None when off."""
        if not rollout_cfg.sync_check:
            return None
        path = {"adapter": "LoRA adapter", "merged": "merged LoRA weights"}.get(lora, "full weights")
        tolerance = rollout_cfg.sync_check_tolerance or TOLERANCE[rollout_cfg.dtype]
        return SyncCheck(f"{path}, {rollout_cfg.dtype}", tolerance)


class SyncCheckFailed(RuntimeError):
    """An engine's weights after a sync are not the learner's (the sync check)."""


def probe_params():
    """vLLM's sampling of the probe: one greedy token, and the logprob of every prompt token (raw, temperature 1)."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)


def prompt_logprobs(output, ids: list[int]) -> list[float]:
    """The logprob vLLM gave each probe token after the first (output.prompt_logprobs: None, then a dict per token)."""
    return [output.prompt_logprobs[i][token].logprob for i, token in enumerate(ids) if i > 0]


def largest_gap(expected: list[float], engines: list[list[float]]) -> tuple[float, int]:
    """(the largest |engine - learner| over the probe's tokens and the engines, the engine it is on)."""
    gaps = [max((abs(a - b) for a, b in zip(expected, got, strict=True)), key=_nan_first) for got in engines]
    worst = max(range(len(gaps)), key=lambda i: _nan_first(gaps[i]))
    return gaps[worst], worst


def _nan_first(gap: float) -> float:
    return math.inf if math.isnan(gap) else gap  # max() would pass a NaN over: it compares false


def check(expected: list[float], engines: list[list[float]], version: int, path: str, tolerance: float) -> float:
    """The gap of one sync (largest_gap), or SyncCheckFailed past `tolerance`."""
    gap, engine = largest_gap(expected, engines)
    if not gap <= tolerance:  # a NaN fails too
        raise SyncCheckFailed(
            f"weight sync of policy version {version} ({path}): engine {engine} scores the probe {gap:.3g} nats "
            f"away from the learner (tolerance {tolerance:g}): it is not sampling the learner's weights"
        )
    return gap

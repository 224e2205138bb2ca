"""algorithm.off_policy.correction: auto, the default, resolved once at launch: tis in an asynchronous mode,
none in sync. Measured on the default preset over 3 seeds (docs/benchmarks.md, "Sync against async"): in_flight
without a correction learned less than sync (held-out sampled accuracy 0.543 against 0.575), tis closed the gap.
An uncorrected asynchronous run is one asked for by name (`correction: none`), and says so at launch."""

from __future__ import annotations

from learner.config import OffPolicyKind
from orchestrator.config.dtype import runs_of
from orchestrator.config.schema import AsyncMode

ASYNC_DEFAULT = OffPolicyKind.tis


def resolve_corrections(tree) -> list[str]:
    """Every run's (a pipeline's RL stage too) `auto` correction set, in place; returns the lines to print."""
    lines = []
    for run in runs_of(tree):
        o, mode = run.algorithm.off_policy, run.async_training.mode
        if o.correction == OffPolicyKind.auto:
            o.correction = OffPolicyKind.none if mode == AsyncMode.sync else ASYNC_DEFAULT
            if mode != AsyncMode.sync:
                lines.append(
                    f"algorithm.off_policy.correction auto -> {o.correction.value} (async_training.mode "
                    f"{mode.value}: samples from engines up to {_behind(run)} behind the learner)"
                )
        elif o.correction == OffPolicyKind.none and mode != AsyncMode.sync:
            lines.append(
                f"algorithm.off_policy.correction none, as asked: async_training.mode {mode.value} trains on "
                "stale samples uncorrected (measured to learn less than sync; auto would take tis)"
            )
    return lines


def _behind(run) -> str:
    if run.async_training.mode == AsyncMode.one_step:
        return "1 version"
    return f"{run.async_training.max_staleness} versions"

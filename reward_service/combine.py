"""Run each reward source with a deadline and failure isolation, then combine them with weights.

A source that raises, or returns the wrong number of scores, is retried one sample at a time so
only the culpable samples are marked; NaN/inf/None scores mark just that sample; a source that
misses its deadline (its whole budget: a remote source's every attempt) marks its samples. One unit
for reward/timeouts: calls (a remote source: chunks) whose samples a timeout lost; a failed attempt
that a retry made good is counted apart (reward/retried_attempts). Nothing here can hang.

A marked sample is one the source could not judge (a failure: timeout, exception, no reference),
never a score; a wrong answer is a score (0). Only sources that train (weight != 0) can make a
sample invalid: a weight-0 source is a metric.
"""

from __future__ import annotations

import logging
import math
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from reward_service.judge import JudgeResult
from reward_service.remote import RemoteResult

log = logging.getLogger(__name__)


@dataclass
class SourceRun:
    """One source's run over a batch: a score per sample (None: could not judge), its timeouts and errors."""

    scores: list[float | None]  # None: invalid for this sample
    timeouts: int = 0  # calls (remote: chunks) whose samples were lost to a timeout
    errors: list[str] = field(default_factory=list)
    retried: int = 0  # remote: failed attempts of chunks that a retry then answered
    counts: dict[str, float] = field(default_factory=dict)  # a judge's (judge/*)


class Deadline(Exception):
    """A source's call ran past its deadline."""

    pass


def call_with_deadline(fn, timeout_s: float):
    """fn() on a helper thread; raise Deadline if it takes longer. A call that never started is
    cancelled; one already running cannot be stopped, so its thread is abandoned to finish alone
    (the message says which: an abandoned thread still holds whatever fn holds)."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relay-reward")
    future = pool.submit(fn)
    try:
        return future.result(timeout=timeout_s)
    except FutureTimeout:
        how = "cancelled before it started" if future.cancel() else "abandoned, still running"
        raise Deadline(f"no result within {timeout_s} s ({how})") from None
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _clean(x) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        try:
            x = float(x)  # numpy / torch scalars
        except (TypeError, ValueError):
            return None
    return float(x) if math.isfinite(x) else None


def _scores_of(out) -> list[float | None]:
    """A source's scores, unwrapped from a judge's or a remote source's result; None: could not score."""
    return [_clean(s) for s in (out.scores if isinstance(out, (JudgeResult, RemoteResult)) else out)]


def run_source(source, prompts: list[str], responses: list[str], metadata: list[dict], timeout_s: float) -> SourceRun:
    """`timeout_s`: the whole call's deadline (for a remote source, all its attempts: see
    sources.deadline_s); a remote source keeps the scores of every chunk that answered."""
    n = len(responses)
    try:
        out = call_with_deadline(lambda: source.score(prompts, responses, metadata), timeout_s)
    except Deadline as e:
        return SourceRun([None] * n, 1, [str(e)])
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    else:
        if isinstance(out, JudgeResult):
            return SourceRun(_scores_of(out), counts=out.counts)
        if isinstance(out, RemoteResult):
            return SourceRun(_scores_of(out), out.timeouts, out.errors, out.retried)
        if len(out) == n:
            return SourceRun(_scores_of(out))
        error = f"returned {len(out)} scores for {n} samples"
    return _one_by_one(source, prompts, responses, metadata, timeout_s, error)


def _one_by_one(source, prompts, responses, metadata, timeout_s, first_error: str) -> SourceRun:
    run = SourceRun([], errors=[first_error])
    for i in range(len(responses)):
        if run.timeouts:  # a source that hangs once is not given another full deadline per sample
            run.scores.append(None)
            continue
        try:
            out = call_with_deadline(
                lambda i=i: source.score(prompts[i : i + 1], responses[i : i + 1], metadata[i : i + 1]), timeout_s
            )
            scores = _scores_of(out) if out is not None else []
            run.scores.append(scores[0] if len(scores) == 1 else None)
        except Deadline as e:
            run.timeouts += 1
            run.errors.append(str(e))
            run.scores.append(None)
        except Exception:
            run.scores.append(None)
    return run


def combine(runs: dict[str, SourceRun], weights: dict[str, float]) -> tuple[list[float], list[bool]]:
    """Weighted sum per sample; a sample is invalid if a source that trains (weight != 0) failed on
    it. A weight-0 source is only reported (reward/<name>/*): its failures change nothing."""
    n = len(next(iter(runs.values())).scores)
    total, invalid = [0.0] * n, [False] * n
    for name, run in runs.items():
        if weights[name] == 0:
            continue
        for i, s in enumerate(run.scores):
            if s is None:
                invalid[i] = True
            else:
                total[i] += weights[name] * s
    return total, invalid


def call_counts(runs: dict[str, SourceRun]) -> dict[str, float]:
    """The call's counts (summed over the calls of a step); the per-source means and invalid
    fractions are of the samples that train, computed from the scores (orchestrator.loop.step_metrics)."""
    for name, run in runs.items():
        bad = sum(s is None for s in run.scores)
        if bad or run.errors:
            log.warning(
                "reward %s: %d of %d samples invalid%s",
                name,
                bad,
                len(run.scores),
                f" ({run.errors[0]})" if run.errors else "",
            )
    counts = {
        "reward/timeouts": float(sum(r.timeouts for r in runs.values())),
        "reward/errors": float(sum(len(r.errors) for r in runs.values())),
        "reward/retried_attempts": float(sum(r.retried for r in runs.values())),
    }
    for run in runs.values():
        for key, value in run.counts.items():
            counts[key] = counts.get(key, 0.0) + value
    return counts

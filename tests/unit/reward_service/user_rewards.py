"""User reward functions for the tests, loaded by `module.path:function` like a user's own."""

import math
import threading


def length(prompts, responses, metadata):
    return [float(len(r)) for r in responses]


def fragile(prompts, responses, metadata):
    """Raises on any batch containing 'boom'; NaN for 'nan'; else 1."""
    if any("boom" in r for r in responses):
        raise RuntimeError("boom in the batch")
    return [math.nan if r == "nan" else 1.0 for r in responses]


def short(prompts, responses, metadata):
    return [1.0] * (len(responses) - 1) if len(responses) > 1 else [1.0]


# `hangs` blocks until a test sets RELEASE, so the test decides when the work ends (after it has
# checked the call came back without it) and can join the thread; the bound is only a safety net
# for a test that forgets, so no thread outlives a run by more than that.
RELEASE = threading.Event()
STARTED = threading.Event()
FINISHED = threading.Event()
HANG_LIMIT_S = 60.0


def hangs(prompts, responses, metadata):
    STARTED.set()
    RELEASE.wait(HANG_LIMIT_S)
    FINISHED.set()
    return [1.0] * len(responses)

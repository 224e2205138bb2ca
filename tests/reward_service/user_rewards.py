"""User reward functions for the tests, loaded by `module.path:function` like a user's own."""
import math
import time


def length(prompts, responses, metadata):
    return [float(len(r)) for r in responses]


def fragile(prompts, responses, metadata):
    """Raises on any batch containing 'boom'; NaN for 'nan'; else 1."""
    if any("boom" in r for r in responses):
        raise RuntimeError("boom in the batch")
    return [math.nan if r == "nan" else 1.0 for r in responses]


def short(prompts, responses, metadata):
    return [1.0] * (len(responses) - 1) if len(responses) > 1 else [1.0]


def hangs(prompts, responses, metadata):
    time.sleep(30)
    return [1.0] * len(responses)

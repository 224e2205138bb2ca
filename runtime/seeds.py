"""Every random stream of a run, derived from the run seed (the config's `seed`) in this one place:
sampling (per request), the engines, environments (per episode), data order, generated task data,
the held-out draw, learner init and dropout, mini-batch order. A stream is named; keys (step,
index, ...) pick its element.

A hash, not an affine mix: with `base * A + step * B + index`, two run seeds gave the same numbers
for the same (step, index) whenever one term was fixed, and neighbouring seeds and keys overlapped.
"""

from __future__ import annotations

import hashlib

SEED_RANGE = 2**31 - 1  # what vLLM, random.Random and torch all take


def stream_seed(run_seed: int, stream: str, *keys: int) -> int:
    """The seed of element `keys` of stream `stream` of the run seeded `run_seed`: the same inputs
    give the same seed in any process (no Python hash randomisation), different ones unrelated seeds."""
    text = ":".join([str(int(run_seed)), stream, *(str(int(k)) for k in keys)])
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") % SEED_RANGE


# The draw of evaluation's requests: training's draws are >= 0 (see request_seed), so evaluation never
# shares a seed with a training batch, and every evaluation draws alike (before/after stay paired).
EVALUATION = -1


def request_seed(run_seed: int, step: int, prompt_index: int, draw: int = 0) -> int:
    """Seed of one prompt's sampling request: a function of the run seed, step, draw and prompt alone,
    so results do not depend on how prompts were spread over workers (and a resumed run samples the
    same). `draw` tells apart the batches launched at one step (the trainer's top-up and dynamic-
    sampling rounds: how many prompts its sampler had handed out), whose prompt indices restart at 0."""
    return stream_seed(run_seed, "sampling", step, draw, prompt_index)


def env_seed(run_seed: int, step: int, prompt_index: int, draw: int, sample: int) -> int:
    """Seed given to the environment of one episode (Environment.reset): the run seed's own stream."""
    return stream_seed(run_seed, "env", step, draw, prompt_index, sample)

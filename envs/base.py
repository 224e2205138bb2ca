"""The environment interface, and running many steps with a deadline.

An Environment holds one episode. relay makes an instance per episode, calls `reset(task, seed)` once and
`step(action)` after every model turn, from worker threads: either may be a coroutine function
(`async def`). A call that raises, returns something malformed or misses env.step_timeout_s ends its
episode (counted); it never stops the run, and never the other episodes.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable


class Environment:
    """Subclass and override `step` (and `reset` if the episode's first prompt is not the data's)."""

    def reset(self, task: dict, seed: int) -> str | list[dict] | None:
        """Start an episode. `task`: the data example's "prompt", "answer" and metadata fields.
        `seed`: for whatever the environment draws at random (e.g. `random.Random(seed)`), from the
        run seed (runtime.seeds.env_seed: per step, batch, prompt and sample), so another run seed
        plays other draws and the same one replays them. Returns the first prompt (text or chat
        messages), or None to use the data's prompt."""
        return None

    def step(self, action: str) -> tuple[str | None, float, bool, dict]:
        """The model's turn as text -> (observation text or None, reward, done, info). The episode's
        return is the sum of its rewards; the observation goes to the model through the chat
        template as a message of role env.observation_role."""
        raise NotImplementedError


@dataclass
class StepResult:
    """One environment call's outcome, a failure (timeout, error) included."""

    observation: str | None = None
    reward: float = 0.0
    done: bool = True
    info: dict = field(default_factory=dict)
    failure: str = ""  # "" ok; "timeout" or "error" (the episode ends)
    message: str = ""  # what went wrong, for the log


def _call(fn: Callable, *args):
    out = fn(*args)
    return asyncio.run(out) if inspect.isawaitable(out) else out  # an async environment: its own loop, on this thread


def call_all(calls: list[tuple[Callable, tuple]], timeout_s: float) -> list[tuple[str, Any]]:
    """Run every fn(*args) at once, each on its own thread, and wait at most timeout_s for them all.
    Returns per call ("", result), ("error", message) or ("timeout", message). A call that misses the
    deadline cannot be stopped: its thread is abandoned to finish alone, and its episode ends."""
    if not calls:
        return []
    pool = ThreadPoolExecutor(max_workers=len(calls), thread_name_prefix="relay-env")
    futures = [pool.submit(_call, fn, *args) for fn, args in calls]
    wait(futures, timeout=timeout_s)
    out = []
    for f in futures:
        if not f.done():
            f.cancel()
            out.append(("timeout", f"no answer within {timeout_s} s"))
        elif f.exception() is not None:
            out.append(("error", f"{type(f.exception()).__name__}: {f.exception()}"))
        else:
            out.append(("", f.result()))
    pool.shutdown(wait=False, cancel_futures=True)
    return out


def step_result(outcome: tuple[str, Any]) -> StepResult:
    """A step's outcome (call_all) as a StepResult; a malformed answer is an error."""
    failure, value = outcome
    if failure:
        return StepResult(failure=failure, message=value)
    try:
        observation, reward, done, info = value
        reward = float(reward)
    except (TypeError, ValueError) as e:
        return StepResult(failure="error", message=f"step() must return (observation, reward, done, info): {e}")
    if not math.isfinite(reward) or not (observation is None or isinstance(observation, str)):
        return StepResult(failure="error", message=f"bad step() result: observation {observation!r}, reward {reward}")
    return StepResult(observation, reward, bool(done), dict(info or {}))

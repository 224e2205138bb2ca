"""relay's built-in environments: small enough that a tiny policy learns them on a CPU in minutes.

- calculator: arithmetic with a tool. A turn "call 347+589" is a tool call, answered with the result;
  any other turn is the final answer, rewarded 1 if it equals the task's answer.
- guess_number: find a secret number; each wrong guess is answered "higher" or "lower", the right
  one ends the episode with reward 1.
"""

from __future__ import annotations

import re

from envs.base import Environment


class Calculator(Environment):
    """Arithmetic with a tool: the policy may call the calculator, then answers; reward 1 for the right sum."""

    def __init__(self, call_prefix: str = "call"):
        self.prefix = call_prefix
        self.pattern = re.compile(rf"^\s*{re.escape(call_prefix)}\s+(-?\d{{1,9}})\s*([-+*])\s*(-?\d{{1,9}})\s*$")
        self.answer = ""

    def reset(self, task: dict, seed: int) -> None:
        self.answer = str(task["answer"]).strip()
        return None

    def step(self, action: str):
        call = self.pattern.match(action)
        if call:
            a, op, b = int(call[1]), call[2], int(call[3])
            return str({"+": a + b, "-": a - b, "*": a * b}[op]), 0.0, False, {"tool_call": True}
        if action.strip().startswith(self.prefix):  # a malformed call: say so, let the model retry
            return "error", 0.0, False, {"tool_call": True}
        return None, float(action.strip() == self.answer), True, {"tool_call": False}


class GuessNumber(Environment):
    """A number-guessing game: each guess is answered higher/lower; a terminal reward for finding it."""

    def __init__(self, low: int = 1, high: int = 15):
        self.low, self.high, self.secret = low, high, None

    def reset(self, task: dict, seed: int) -> None:
        self.secret = int(task["answer"])
        if not self.low <= self.secret <= self.high:
            raise ValueError(f"secret {self.secret} outside [{self.low}, {self.high}]")
        return None

    def step(self, action: str):
        try:
            guess = int(action.strip())
        except ValueError:
            return "bad", 0.0, False, {}
        if guess == self.secret:
            return None, 1.0, True, {}
        return ("higher" if guess < self.secret else "lower"), 0.0, False, {}


BUILTIN = {"calculator": Calculator, "guess_number": GuessNumber}

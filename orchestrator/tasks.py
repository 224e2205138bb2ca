"""Built-in prompt sources: relay's tiny arithmetic tasks and any reasoning-gym task, by name.

Each example is {"prompt": str, "answer": str, "metadata": {...}}, the same shape the JSONL/Parquet
loader produces, so rewards see one format whatever the source.
"""
from __future__ import annotations

import random

TINY_TASKS = {"addition_2digit": (10, 99), "addition_3digit": (100, 999),
              # the same sums asked in words, for instruction-tuned models (SmolLM2-135M: ~12% greedy)
              "chat_addition_2digit": (10, 99)}


def tiny_arithmetic(name: str, n: int, seed: int) -> list[dict]:
    low, high = TINY_TASKS[name]
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(low, high), rng.randint(low, high)
        prompt = f"What is {a} + {b}? Answer with just the number." if name.startswith("chat_") else f"{a}+{b}="
        out.append({"prompt": prompt, "answer": str(a + b), "metadata": {}})
    return out


def guess_number(n: int, seed: int, low: int = 1, high: int = 15) -> list[dict]:
    """The guess_number environment's episodes: the secret is the answer (envs/builtin.py)."""
    rng = random.Random(seed)
    return [{"prompt": f"guess {low}-{high}:", "answer": str(rng.randint(low, high)), "metadata": {}} for _ in range(n)]


def reasoning_gym_task(name: str, n: int, seed: int) -> list[dict]:
    """A reasoning-gym task as chat messages: reasoning-gym's default system prompt (answer inside
    <answer></answer>, which its scorers read) and the question; needs a model with a chat template."""
    import reasoning_gym
    from reasoning_gym.utils import SYSTEM_PROMPTS

    try:
        data = reasoning_gym.create_dataset(name, size=n, seed=seed)
    except (KeyError, ValueError) as e:
        raise ValueError(f"data.task: unknown task {name!r} (relay: {', '.join(TINY_TASKS)}; or a reasoning-gym "
                         f"task): {e}") from None
    system = {"role": "system", "content": SYSTEM_PROMPTS["default"]}
    return [{"prompt": [system, {"role": "user", "content": e["question"]}], "answer": str(e["answer"]),
             "metadata": {"entry": e}} for e in data]


# Tasks whose examples all share one prompt: what differs (guess_number's secret) is hidden from the
# policy, so no prompt can be unseen; their held-out set is fresh episodes of the same prompt.
ONE_PROMPT_TASKS = {"guess_number"}


def make_task(name: str, n: int, seed: int) -> list[dict]:
    if name == "guess_number":
        return guess_number(n, seed)
    return tiny_arithmetic(name, n, seed) if name in TINY_TASKS else reasoning_gym_task(name, n, seed)

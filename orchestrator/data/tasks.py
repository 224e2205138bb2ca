"""Built-in prompt sources: relay's tiny arithmetic tasks and any reasoning-gym task, by name.

Each example is {"prompt": str, "answer": str, "metadata": {...}}, the same shape the JSONL/Parquet
loader produces, so rewards see one format whatever the source.
"""

from __future__ import annotations

import hashlib
import json
import random

TINY_TASKS = {
    "addition_2digit": (10, 99),
    "addition_3digit": (100, 999),
    # the same sums asked in words, for instruction-tuned models (SmolLM2-135M: ~12% greedy)
    "chat_addition_2digit": (10, 99),
}
RELAY_TASKS = [*TINY_TASKS, "repeat_longtail", "guess_number"]  # relay's own, besides reasoning-gym's


def tiny_arithmetic(name: str, n: int, seed: int) -> list[dict]:
    low, high = TINY_TASKS[name]
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(low, high), rng.randint(low, high)
        prompt = f"What is {a} + {b}? Answer with just the number." if name.startswith("chat_") else f"{a}+{b}="
        out.append({"prompt": prompt, "answer": str(a + b), "metadata": {}})
    return out


def repeat_longtail(n: int, seed: int, long_share: float = 0.2) -> list[dict]:
    """Repeat a number k times ("3x47=" -> "474747"): most prompts repeat a 2- or 3-digit number 1-3
    times, a `long_share` of them a 2-digit one 12-20 times, so answers run from 2 to 40 tokens and a
    batch's longest samples outlast the rest many times over (the long tail that continuous batching
    and in-flight updates are for)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if rng.random() < long_share:
            number, k = rng.randint(10, 99), rng.randint(12, 20)
        else:
            number, k = rng.randint(10, 999), rng.randint(1, 3)
        out.append({"prompt": f"{k}x{number}=", "answer": str(number) * k, "metadata": {}})
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
        raise ValueError(
            f"data.task: unknown task {name!r} (relay: {', '.join(RELAY_TASKS)}; or a reasoning-gym task): {e}"
        ) from None
    system = {"role": "system", "content": SYSTEM_PROMPTS["default"]}
    return [
        {
            "prompt": [system, {"role": "user", "content": e["question"]}],
            "answer": str(e["answer"]),
            "metadata": {"entry": e},
        }
        for e in data
    ]


# Tasks whose examples all share one prompt: what differs (guess_number's secret) is hidden from the
# policy, so no prompt can be unseen; their held-out set is fresh episodes of the same prompt.
ONE_PROMPT_TASKS = {"guess_number"}


def make_task(name: str, n: int, seed: int) -> list[dict]:
    if name == "guess_number":
        return guess_number(n, seed)
    if name == "repeat_longtail":
        return repeat_longtail(n, seed)
    return tiny_arithmetic(name, n, seed) if name in TINY_TASKS else reasoning_gym_task(name, n, seed)


# One prompt in RESERVE_ONE_IN of a generated task is held-out only, whatever the seed, stage or command:
# no run, SFT/RM stage or built-in starting policy ever trains on it, so a held-out set drawn from these
# is unseen by everything that came before (the pipeline's stages, `relay data`, builtin://). 1 in 8
# leaves ~1000 of the 8100 two-digit sums for held-out sets (the presets hold out at most 512).
RESERVE_ONE_IN = 8


class TaskTooSmall(ValueError):
    """A generated task gives too few examples of the kind asked for (draw_task)."""


def prompt_id(prompt) -> str:
    """A prompt's identity (text, chat messages or token ids), for telling held-out from training."""
    return json.dumps(prompt, sort_keys=True)


def reserved(prompt) -> bool:
    """Whether a generated task's prompt is reserved for held-out sets: a stable hash of the prompt
    (not Python's hash(), which changes per process)."""
    digest = hashlib.blake2b(prompt_id(prompt).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % RESERVE_ONE_IN == 0


def draw_task(name: str, n: int, seed: int, held_out: bool) -> list[dict]:
    """n examples of make_task(name, ., seed), in its order: the first n distinct reserved prompts
    (held_out), or the first n examples whose prompt is not reserved (training). A task of one prompt
    (ONE_PROMPT_TASKS) reserves nothing: its examples as they are. A task's first k examples are the
    same for every size, so a bigger draw only adds examples. Raises TaskTooSmall where the task gives
    too few within 16 x RESERVE_ONE_IN x n (+64) examples."""
    if name in ONE_PROMPT_TASKS:
        return make_task(name, n, seed)
    r, limit = RESERVE_ONE_IN, 16 * RESERVE_ONE_IN * n + 64
    size = n * r * 5 // 4 + 64 if held_out else n * r // (r - 1) + n // 20 + 16  # expected to be enough at once
    while True:
        out, seen = [], set()
        for e in make_task(name, size, seed):
            key = prompt_id(e["prompt"])
            if len(out) < n and reserved(e["prompt"]) == held_out and not (held_out and key in seen):
                seen.add(key)
                out.append(e)
        if len(out) == n or size >= limit:
            break
        size = min(2 * size, limit)
    if len(out) < n:
        kind = "distinct prompts reserved for held-out sets" if held_out else "examples with a trainable prompt"
        raise TaskTooSmall(f"{size} examples hold only {len(out)} {kind}, short of {n}")
    return out

"""Offline data for the SFT and reward-model stages, built from verifiable tasks (nothing ships a
preference set here). Written as JSONL in the formats a user's own data uses:

    demonstrations:   {"prompt": ..., "response": ...}
    preference pairs: {"prompt": ..., "chosen": ..., "rejected": ...}

A pair's chosen response is the task's correct answer, the rejected one a plausible wrong answer: the
number moved by a small nonzero offset, or one character changed (`preferences`), or, as RLHF practice
builds them, one of a model's own wrong samples for that prompt (`sampled_preferences`), so that the
reward model learns to tell apart the near-misses the policy actually makes.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path


def demonstrations(examples: list[dict]) -> list[dict]:
    """Task examples (orchestrator/data/tasks.py) as demonstrations."""
    return [{"prompt": e["prompt"], "response": e["answer"]} for e in examples]


def preferences(examples: list[dict], seed: int) -> list[dict]:
    """Task examples as preference pairs; `seed` picks the rejected answers: give it a stream of its own
    (runtime.seeds.stream_seed), not the task's seed, or the picks replay the task's random sequence."""
    rng = random.Random(seed)
    return [{"prompt": e["prompt"], "chosen": e["answer"], "rejected": corrupt(e["answer"], rng)} for e in examples]


def sampled_preferences(
    examples: list[dict], samples: list[list[str]], wrong: Callable[[str, str], bool], seed: int
) -> tuple[list[dict], int]:
    """(pairs, how many took a sampled rejection). Each example's rejected answer is one of its samples that
    `wrong(sample, answer)` calls wrong, drawn with their frequency (the model's common mistakes weigh most);
    an example with no wrong sample gets a `corrupt` one. `seed`: a stream of its own, as for preferences."""
    rng, pairs, sampled = random.Random(seed), [], 0
    for e, answers in zip(examples, samples, strict=True):
        misses = [a.strip() for a in answers if a.strip() and wrong(a, e["answer"])]
        sampled += bool(misses)
        rejected = rng.choice(misses) if misses else corrupt(e["answer"], rng)
        pairs.append({"prompt": e["prompt"], "chosen": e["answer"], "rejected": rejected})
    return pairs, sampled


def corrupt(answer: str, rng: random.Random) -> str:
    """A wrong answer near the right one: an integer moved by 1-10 either way (never onto itself),
    else one character replaced."""
    try:
        value = int(answer)
    except ValueError:
        if not answer:
            return "?"
        i = rng.randrange(len(answer))
        return answer[:i] + ("x" if answer[i] != "x" else "y") + answer[i + 1 :]
    return str(value + rng.choice([-1, 1]) * rng.randint(1, 10))


def write_jsonl(rows: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path

"""Prompts for the loop: JSONL/Parquet files or a built-in/reasoning-gym task, and a seeded,
resumable sampler over them. A bad line is named by file and line, then stops the run or is
skipped and counted (data.on_bad_line)."""
from __future__ import annotations

import json
import logging
import random
from pathlib import Path

from orchestrator.config import BadLinePolicy, DataConfig
from orchestrator.tasks import make_task
from rollout.prompts import is_chat, is_token_ids

log = logging.getLogger(__name__)


class DataError(ValueError):
    """A bad example in a data file, named by file and line."""


def read_records(path: Path):
    """(line number, record or the parse error) for each non-empty line/row."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for i, row in enumerate(pq.read_table(path).to_pylist(), start=1):
            yield i, row
        return
    with path.open(encoding="utf-8") as f:
        for i, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield i, json.loads(line)
            except json.JSONDecodeError as e:
                yield i, DataError(f"not valid JSON ({e.msg})")


def _example(record, cfg: DataConfig) -> dict:
    if not isinstance(record, dict):
        raise DataError(f"expected a JSON object, got {type(record).__name__}")
    if cfg.prompt_key not in record:
        raise DataError(f"no {cfg.prompt_key!r} field (data.prompt_key)")
    prompt = record[cfg.prompt_key]
    if not (isinstance(prompt, str) and prompt.strip()) and not is_chat(prompt) and not is_token_ids(prompt):
        raise DataError(f"{cfg.prompt_key!r} must be non-empty text, a list of chat messages or a list of "
                        f"non-negative token ids, got {str(prompt)[:40]!r}")
    answer = record.get(cfg.answer_key)
    metadata = {k: v for k, v in record.items() if k not in (cfg.prompt_key, cfg.answer_key)}
    return {"prompt": prompt, "answer": None if answer is None else str(answer), "metadata": metadata}


def policy_prompt(prompt, apply_chat_template: bool):
    """The prompt the policy is given (in RL, and in SFT/RM training): text as is, or as one user
    message when the config asks for the chat template; chat messages and token ids as they are."""
    return [{"role": "user", "content": prompt}] if apply_chat_template and isinstance(prompt, str) else prompt


def reward_metadata(example: dict, apply_chat_template: bool) -> dict:
    """What rewards get about a prompt: its answer, the data's other fields, and the prompt as the
    policy was given it (a reward model renders it the way `relay rm` trained on it)."""
    return {"answer": example["answer"], **example["metadata"], "prompt": policy_prompt(example["prompt"], apply_chat_template)}


def read_examples(files: list[str], parse, on_bad_line: BadLinePolicy) -> tuple[list, int]:
    """`parse(record)` of every line of `files` (it raises DataError for a bad one), and how many
    bad lines were skipped; under on_bad_line=error the first bad line stops, named file:line."""
    examples, skipped = [], 0
    for name in files:
        path = Path(name)
        if not path.exists():
            raise DataError(f"{path}: no such data file")
        for line, record in read_records(path):
            try:
                if isinstance(record, DataError):
                    raise record
                examples.append(parse(record))
            except DataError as e:
                if on_bad_line == BadLinePolicy.error:
                    raise DataError(f"{path}:{line}: {e}") from None
                skipped += 1
                log.warning("data: skipping %s:%d: %s", path, line, e)
    return examples, skipped


def load_examples(files: list[str], cfg: DataConfig) -> tuple[list[dict], int]:
    """All examples of `files`, and how many bad lines were skipped."""
    examples, skipped = read_examples(files, lambda record: _example(record, cfg), cfg.on_bad_line)
    if not examples:
        raise DataError(f"{', '.join(files)}: no usable examples")
    return examples, skipped


def load_split(cfg: DataConfig, seed: int) -> tuple[list[dict], list[dict], int]:
    """(train, eval, skipped lines). A task is generated; held-out prompts come from another seed.
    Without eval files, eval_size examples drawn at random (seeded) are held out and taken out of
    the training set; a random draw, not the first lines, since files are often ordered."""
    if cfg.task:
        return make_task(cfg.task, cfg.task_size, seed), make_task(cfg.task, cfg.eval_size, seed + 999_983), 0
    train, skipped = load_examples(cfg.train_files, cfg)
    if cfg.eval_files:
        held_out, skipped_eval = load_examples(cfg.eval_files, cfg)
        return train, held_out[: cfg.eval_size], skipped + skipped_eval
    if len(train) <= cfg.eval_size:
        raise DataError(f"{', '.join(cfg.train_files)}: {len(train)} usable examples leave none to train on after "
                        f"holding out data.eval_size ({cfg.eval_size}); lower it or give data.eval_files")
    order = list(range(len(train)))
    random.Random(seed + 999_983).shuffle(order)
    held = set(order[: cfg.eval_size])
    return ([e for i, e in enumerate(train) if i not in held], [train[i] for i in sorted(held)], skipped)


class PromptSampler:
    """Epochs over the examples in a seeded shuffled order; its state is (epoch, position)."""

    def __init__(self, n: int, seed: int, shuffle: bool):
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        order = list(range(self.n))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def next(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.position == self.n:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._make_order()
            take = min(k - len(out), self.n - self.position)
            out += self._order[self.position: self.position + take]
            self.position += take
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._make_order()

"""Prompts for the loop: JSONL/Parquet files or a built-in/reasoning-gym task, and a seeded,
resumable sampler over them. A bad line is named by file and line, then stops the run or is
skipped and counted (data.on_bad_line)."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

from orchestrator.config.schema import BadLinePolicy, DataConfig
from orchestrator.data.tasks import RESERVE_ONE_IN, TaskTooSmall, draw_task, prompt_id
from runtime.prompts import is_chat, is_token_ids
from runtime.seeds import stream_seed

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
        raise DataError(
            f"{cfg.prompt_key!r} must be non-empty text, a list of chat messages or a list of "
            f"non-negative token ids, got {str(prompt)[:40]!r}"
        )
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
    return {
        "answer": example["answer"],
        **example["metadata"],
        "prompt": policy_prompt(example["prompt"], apply_chat_template),
    }


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
    """(train, eval, skipped lines). No held-out prompt is ever a training prompt: see task_split,
    hold_out and drop_overlap."""
    if cfg.task:
        return *task_split(cfg.task, cfg.task_size, cfg.eval_size, seed), 0
    train, skipped = load_examples(cfg.train_files, cfg)
    if not cfg.eval_files:
        return *hold_out(train, cfg.eval_size, seed, lambda e: e["prompt"], ", ".join(cfg.train_files)), skipped
    held_out, skipped_eval = load_examples(cfg.eval_files, cfg)
    held_out = held_out[: cfg.eval_size]
    return drop_overlap(train, held_out, lambda e: e["prompt"], "data.eval_files"), held_out, skipped + skipped_eval


def suite_examples(suite, data: DataConfig, seed: int, train: list[dict]) -> tuple[list[dict], int]:
    """(examples, training prompts left out) of an eval suite (schema.EvalSuite): a task's held-out
    prompts (reserved: no training draw of that task has them; the suite's own stream of the run seed),
    or a file's first `size` examples once any training prompt among them is left out."""
    if suite.task:
        try:
            return draw_task(suite.task, suite.size, stream_seed(seed, f"suite/{suite.name}"), held_out=True), 0
        except TaskTooSmall as e:
            raise DataError(f"eval.suites {suite.name!r}: task {suite.task!r}: {e}; lower its size") from None
    examples, _ = load_examples([suite.file], data)
    trained = {prompt_id(e["prompt"]) for e in train}
    kept, left_out = [], 0
    for e in examples:
        if len(kept) == suite.size:
            break
        if prompt_id(e["prompt"]) in trained:
            left_out += 1
        else:
            kept.append(e)
    return kept, left_out


def task_split(task: str, train_size: int, eval_size: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, held-out) of a generated task, from the run seed's task and held-out streams: training
    examples have unreserved prompts only, the held-out set is eval_size distinct reserved ones
    (tasks.reserved: the same prompts for every seed and stage, so no stage or built-in starting
    policy trained on them either). A task of one prompt (tasks.ONE_PROMPT_TASKS) has fresh episodes
    as its held-out set. Fails, naming the keys, where the task has too few prompts."""
    try:
        train = draw_task(task, train_size, stream_seed(seed, "task"), held_out=False)
        held_out = draw_task(task, eval_size, stream_seed(seed, "held_out"), held_out=True)
    except TaskTooSmall as e:
        raise DataError(
            f"data.task {task!r}: {e} (data.task_size: {train_size}, data.eval_size: {eval_size}): the "
            f"task has too few distinct prompts (1 in {RESERVE_ONE_IN} is held-out only); lower them"
        ) from None
    return train, held_out


def hold_out(examples: list[dict], eval_size: int, seed: int, prompt_of, source: str) -> tuple[list[dict], list[dict]]:
    """(train, held-out): eval_size distinct prompts drawn at random (the run seed's held-out stream;
    not the first lines, since files are often ordered), one example each; every example with one of
    them leaves training, repeated lines included."""
    first: dict[str, int] = {}
    for i, e in enumerate(examples):
        first.setdefault(prompt_id(prompt_of(e)), i)
    if len(first) <= eval_size:
        raise DataError(
            f"{source}: {len(first)} distinct prompts leave none to train on after holding out "
            f"data.eval_size ({eval_size}); lower it or give data.eval_files"
        )
    keys = list(first)
    random.Random(stream_seed(seed, "held_out")).shuffle(keys)
    held = set(keys[:eval_size])
    train = [e for e in examples if prompt_id(prompt_of(e)) not in held]
    return train, [examples[first[k]] for k in sorted(held, key=first.get)]


def drop_overlap(train: list[dict], held_out: list[dict], prompt_of, source: str) -> list[dict]:
    """The training examples whose prompt is not a held-out one; the dropped ones are counted in the log."""
    held = {prompt_id(prompt_of(e)) for e in held_out}
    kept = [e for e in train if prompt_id(prompt_of(e)) not in held]
    if len(kept) < len(train):
        log.warning(
            "data: %d training examples have a prompt of %s: dropped from training", len(train) - len(kept), source
        )
    if not kept:
        raise DataError(f"every training example has a prompt of {source}: none left to train on")
    return kept


class PromptSampler:
    """Epochs over the examples in a seeded shuffled order; its state is (epoch, position)."""

    def __init__(self, n: int, seed: int, shuffle: bool):
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        order = list(range(self.n))
        if self.shuffle:
            random.Random(stream_seed(self.seed, "data_order", self.epoch)).shuffle(order)
        return order

    @property
    def drawn(self) -> int:
        """Prompts handed out so far (epochs included): a new number after every draw."""
        return self.epoch * self.n + self.position

    def next(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.position == self.n:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._make_order()
            take = min(k - len(out), self.n - self.position)
            out += self._order[self.position : self.position + take]
            self.position += take
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._make_order()

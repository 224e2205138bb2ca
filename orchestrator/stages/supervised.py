"""`relay sft` and `relay rm`: supervised stages on the learner's DeepSpeed ranks.

    data (files, or generated from a task) -> tokenised batches -> N optimizer steps, held-out
    evaluation every eval_every steps -> runs/<name>/model, a plain Hugging Face folder

The SFT model may start from scratch (config-only GPT-2 plus a character or locally trained BPE
tokenizer). The RM folder also holds relay_reward_stats.json (its reward mean/std on held-out
data), which the reward service's reward_model source uses to normalise.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
from pathlib import Path

import torch

from learner.supervised import RM, SFT, SupervisedGroup
from orchestrator.config.load import to_dict
from orchestrator.config.schema import RejectedFrom, StageConfig
from orchestrator.data.generate import demonstrations, preferences, sampled_preferences, write_jsonl
from orchestrator.data.prompts import DataError, drop_overlap, hold_out, policy_prompt, read_examples, task_split
from orchestrator.loop.tracking import Tracker
from reward_service.rm_input import pad_right, rm_input_ids
from reward_service.sources import REWARD_STATS_FILE
from runtime.prompts import encode_chat, encode_text
from runtime.seeds import stream_seed


def run_stage(cfg: StageConfig, kind: str) -> Path:
    """Train one stage; returns the output model folder."""
    import ray

    run_dir = Path(cfg.run_root) / cfg.name
    train_rows, eval_rows, skipped = load_supervised(cfg, kind, run_dir)
    model_path = cfg.learner.model_path or str(build_scratch_model(cfg, train_rows, run_dir / "init"))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    encode = encode_sft if kind == SFT else encode_rm
    train_batch, too_long = encode(tokenizer, train_rows, cfg)
    eval_batch, too_long_eval = encode(tokenizer, eval_rows, cfg)
    counts = {"data/skipped_lines": skipped, "data/skipped_too_long": too_long + too_long_eval}
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False)
    group = SupervisedGroup(
        dataclasses.replace(cfg.learner, model_path=model_path), cfg.train, kind, cfg.learner_ranks, cfg.seed
    )
    tracker = Tracker(cfg.logging, run_dir, cfg.name.replace("/", "_"), to_dict(cfg), resumed_at=None)
    try:
        first = evaluation(group, eval_batch, kind)
        tracker.log(0, {**first, **counts}, cfg.train.steps)
        last = train_loop(cfg, group, train_batch, eval_batch, kind, tracker, counts)
        out = run_dir / "model"
        tmp = run_dir / "model.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        group.save(str(tmp))
        if kind == SFT and cfg.data.task and not cfg.data.apply_chat_template:
            last["eval/greedy_accuracy"] = task_accuracy(tmp, eval_rows, cfg)
            tracker.log(cfg.train.steps, {"eval/greedy_accuracy": last["eval/greedy_accuracy"]}, cfg.train.steps)
        summary = {"stage": kind, "before": first, "after": last, **counts}
        if kind == RM:  # what the reward service normalises this model's scores with
            summary.update(mean=last["eval/reward_mean"], std=max(last["eval/reward_std"], 1e-6))
        (tmp / (REWARD_STATS_FILE if kind == RM else "relay_sft.json")).write_text(json.dumps(summary, indent=1))
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    finally:
        group.shutdown()
        tracker.close()
    print(stage_table(kind, first, last), flush=True)
    print(f"relay {kind}: model written to {out}", flush=True)
    return out


def train_loop(cfg: StageConfig, group: SupervisedGroup, train_batch, eval_batch, kind: str, tracker, counts) -> dict:
    n = len(next(iter(train_batch.values())))
    g = torch.Generator().manual_seed(cfg.seed)
    order, pos, last, start = torch.randperm(n, generator=g), 0, {}, time.time()
    for step in range(1, cfg.train.steps + 1):
        if pos + cfg.train.batch_size > n:  # next epoch
            order, pos = torch.randperm(n, generator=g), 0
        rows = order[pos : pos + cfg.train.batch_size]
        pos += cfg.train.batch_size
        sums = group.train_step({k: v[rows] for k, v in train_batch.items()})
        metrics = {"train/loss": sums["loss_sum"] / max(sums["count"], 1), "train/grad_norm": sums["grad_norm"]}
        if kind == RM:
            metrics["train/pairwise_accuracy"] = sums["correct"] / max(sums["count"], 1)
        if step % cfg.train.eval_every == 0 or step == cfg.train.steps:
            last = evaluation(group, eval_batch, kind)
            metrics.update(last)
            print(
                f"relay {kind}: step {step}/{cfg.train.steps}  "
                + "  ".join(f"{k.removeprefix('eval/')} {v:.4f}" for k, v in last.items())
                + f"  {time.time() - start:.0f}s",
                flush=True,
            )
        tracker.log(step, {**metrics, **counts}, cfg.train.steps)
    return last


def task_accuracy(model_dir: Path, rows: list[dict], cfg: StageConfig) -> float:
    """Held-out greedy accuracy of a verifiable task (the answer checked as a number)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from learner.sft import greedy_accuracy

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    examples = [{"prompt": r[cfg.data.prompt_key], "answer": r[cfg.data.response_key]} for r in rows]
    return greedy_accuracy(model, AutoTokenizer.from_pretrained(model_dir), examples)


def evaluation(group: SupervisedGroup, batch, kind: str) -> dict[str, float]:
    sums = group.evaluate(batch)
    loss = sums["loss_sum"] / max(sums["count"], 1)
    if kind == SFT:
        return {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 50.0))}
    rewards = torch.tensor(sums["rewards"])
    return {
        "eval/loss": loss,
        "eval/pairwise_accuracy": sums["correct"] / max(sums["count"], 1),
        "eval/reward_mean": float(rewards.mean()),
        "eval/reward_std": float(rewards.std()),
    }


def stage_table(kind: str, before: dict, after: dict) -> str:
    lines = ["", f"{'held-out (' + kind + ')':30s} {'before':>10s} {'after':>10s}", "-" * 52]
    lines += [f"{k.removeprefix('eval/'):30s} {before.get(k, float('nan')):10.4f} {after[k]:10.4f}" for k in after]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- data
def load_supervised(cfg: StageConfig, kind: str, run_dir: Path) -> tuple[list[dict], list[dict], int]:
    """(train rows, held-out rows, skipped bad lines). A task is generated into the run directory first,
    so generated and user data go through the same reader. No held-out prompt is a training prompt
    (orchestrator/data/prompts.py: task_split, hold_out, drop_overlap)."""
    d = cfg.data
    train_files, eval_files = list(d.train_files), list(d.eval_files)
    if d.task:

        def rows(examples, stream):
            if kind == SFT:
                return demonstrations(examples)
            if d.rejected_from == RejectedFrom.samples:
                return model_preferences(cfg, examples, stream, run_dir)
            return preferences(examples, stream_seed(cfg.seed, stream))

        train_set, held_set = task_split(d.task, d.task_size, d.eval_size, cfg.seed)
        train_files = [str(write_jsonl(rows(train_set, "rejected"), run_dir / "data" / f"{kind}_train.jsonl"))]
        eval_files = [str(write_jsonl(rows(held_set, "held_out_rejected"), run_dir / "data" / f"{kind}_eval.jsonl"))]
    fields = [d.prompt_key, d.response_key] if kind == SFT else [d.prompt_key, d.chosen_key, d.rejected_key]

    def parse(record) -> dict:
        problem = _problem(record, fields)
        if problem:
            raise DataError(problem)
        return {f: record[f] for f in fields}

    train, skipped = read_examples(train_files, parse, d.on_bad_line)
    prompt_of, more = (lambda r: r[d.prompt_key]), 0
    if not eval_files:
        train, held_out = hold_out(train, d.eval_size, cfg.seed, prompt_of, ", ".join(train_files))
    else:
        held_out, more = read_examples(eval_files, parse, d.on_bad_line)
        held_out = held_out[: d.eval_size]
        if not d.task:  # a task's split is disjoint already (and a one-prompt task's held-out is fresh episodes)
            train = drop_overlap(train, held_out, prompt_of, "data.eval_files")
    if not train or not held_out:
        raise DataError(f"{', '.join(train_files)}: too few usable examples for a train and a held-out split")
    return train, held_out, skipped + more


def model_preferences(cfg: StageConfig, examples: list[dict], stream: str, run_dir: Path) -> list[dict]:
    """Pairs whose rejected answers are the starting model's own wrong samples (data.rejected_from: samples),
    graded by math-verify against the task's answers; prints, and writes to data/, how many pairs got one."""
    from learner.sft import sample_answers
    from reward_service.rules import math_answer

    d = cfg.data
    if not cfg.learner.model_path:
        raise DataError("data.rejected_from: samples needs learner.model_path (the model whose mistakes to rank)")
    if any(math_answer(e["answer"], e["answer"]) is None or not isinstance(e["prompt"], str) for e in examples):
        raise DataError("data.rejected_from: samples needs answers math-verify grades, and text prompts")
    prompts = [e["prompt"] for e in examples]
    samples = sample_answers(cfg.learner.model_path, prompts, d.rejected_samples, stream_seed(cfg.seed, stream))
    pairs, sampled = sampled_preferences(
        examples, samples, lambda a, ref: math_answer(a, ref) != 1.0, stream_seed(cfg.seed, f"{stream}_pick")
    )
    note = {"pairs": len(pairs), "rejected_sampled": sampled, "samples_per_prompt": d.rejected_samples}
    write_jsonl([note], run_dir / "data" / f"{stream}_counts.jsonl")
    which = "held-out" if stream.startswith("held_out") else "training"
    print(
        f"relay rm: {which} pairs: {sampled}/{len(pairs)} rejected answers are the model's own wrong samples "
        f"({d.rejected_samples} per prompt), the rest corrupted right answers",
        flush=True,
    )
    return pairs


def _problem(record, fields: list[str]) -> str | None:
    if not isinstance(record, dict):
        return f"expected a JSON object, got {type(record).__name__}"
    for f in fields:
        value = record.get(f)
        chat = (
            isinstance(value, list)
            and value
            and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in value)
        )
        if not (isinstance(value, str) and value) and not (chat and f == fields[0]):
            kinds = "non-empty text" + (" or chat messages" if f == fields[0] else "")
            return f"field {f!r} must be {kinds}, got {str(value)[:40]!r}"
    return None


def encode_sft(tokenizer, rows: list[dict], cfg: StageConfig) -> tuple[dict[str, torch.Tensor], int]:
    """Prompt + response + EOS, right-padded; the loss covers the response and EOS only. The prompt's
    ids are those the rollout workers give the policy (encode_text/encode_chat: a BOS where the
    tokenizer adds one, never two). Samples over max_length tokens are skipped and counted."""
    d = cfg.data
    seqs, starts = [], []
    for r in rows:
        p = policy_prompt(r[d.prompt_key], d.apply_chat_template)
        prompt = encode_chat(tokenizer, p) if isinstance(p, list) else encode_text(tokenizer, p)
        response = tokenizer(r[d.response_key], add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        if len(prompt) + len(response) <= cfg.train.max_length:
            seqs.append(prompt + response)
            starts.append(len(prompt))
    if not seqs:
        raise DataError(f"every sample is longer than train.max_length {cfg.train.max_length} tokens")
    ids = torch.full((len(seqs), max(len(s) for s in seqs)), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), ids.shape[1] - 1)
    for i, (s, start) in enumerate(zip(seqs, starts)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, start - 1 : len(s) - 1] = 1.0  # targets are ids[1:]: the response and EOS
    attention = (ids != tokenizer.pad_token_id).long()
    attention[:, 0] = 1
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": mask}, len(rows) - len(seqs)


def encode_rm(tokenizer, rows: list[dict], cfg: StageConfig) -> tuple[dict[str, torch.Tensor], int]:
    """Prompt + response as the reward service will score them (reward_service.rm_input: the same
    function), right-padded, for the chosen and the rejected response of each pair."""
    d = cfg.data
    prompts = [policy_prompt(r[d.prompt_key], d.apply_chat_template) for r in rows]
    chosen = [rm_input_ids(tokenizer, p, r[d.chosen_key]) for p, r in zip(prompts, rows)]
    rejected = [rm_input_ids(tokenizer, p, r[d.rejected_key]) for p, r in zip(prompts, rows)]
    keep = [i for i in range(len(rows)) if max(len(chosen[i]), len(rejected[i])) <= cfg.train.max_length]
    if not keep:
        raise DataError(f"every pair is longer than train.max_length {cfg.train.max_length} tokens")
    out = {}
    for name, seqs in (("chosen", chosen), ("rejected", rejected)):
        out[f"{name}_ids"], out[f"{name}_attention"] = pad_right([seqs[i] for i in keep], tokenizer.pad_token_id)
    return out, len(rows) - len(keep)


# ---------------------------------------------------------------------------- from scratch
def build_scratch_model(cfg: StageConfig, rows: list[dict], out: Path) -> Path:
    """A config-only GPT-2 and its tokenizer: characters, or BPE trained on the training text."""
    from learner.tiny_gpt import init_tiny_gpt, train_bpe_tokenizer

    s = cfg.scratch
    tokenizer = None
    if s.tokenizer == "bpe":
        texts = [str(r[k]) for r in rows for k in (cfg.data.prompt_key, cfg.data.response_key)]
        tokenizer = train_bpe_tokenizer(texts, s.vocab_size)
    shutil.rmtree(out, ignore_errors=True)
    return init_tiny_gpt(
        out,
        n_layer=s.n_layer,
        n_embd=s.n_embd,
        n_head=s.n_head,
        n_positions=s.n_positions,
        seed=cfg.seed,
        tokenizer=tokenizer,
    )

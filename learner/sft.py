"""Supervised fine-tuning of a small model in one process: next-token loss on the response only.

Used to build relay's tiny starting policies (a GPT trained from scratch on a task to partial
accuracy) for the default demo and the end-to-end tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from learner import algorithms as A
from runtime.logprobs import logprobs_from_logits


def encode_pairs(tokenizer, pairs: list[tuple[str, str]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids (N, L), loss_mask (N, L-1)): prompt + response + EOS, right-padded; the mask
    covers the response and EOS targets only."""
    seqs, starts = [], []
    for prompt, response in pairs:
        p = tokenizer(prompt).input_ids  # as the rollout engines tokenize a text prompt (a BOS if the model adds one)
        r = tokenizer(response, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        seqs.append(p + r)
        starts.append(len(p))
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), L - 1)
    for i, (s, start) in enumerate(zip(seqs, starts)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, start - 1 : len(s) - 1] = 1.0
    return ids, mask


@dataclass
class SFTSchedule:
    """How sft trains: AdamW with a linear decay to 0 over `steps`, on random batches."""

    steps: int  # optimizer steps (at most: `stop` may end training early)
    batch_size: int = 64  # sequences per step, drawn with replacement
    lr: float = 3e-3  # the starting learning rate
    seed: int = 0  # the batch draws' generator
    log_every: int = 0  # print the loss every this many steps; 0 = never
    stop: Callable[[], bool] | None = None  # asked every `check_every` steps; True ends training
    check_every: int = 100


def sft(model, tokenizer, pairs: list[tuple[str, str]], schedule: SFTSchedule) -> list[float]:
    """Train in place on (prompt, response) pairs; return the loss of every step."""
    ids, mask = encode_pairs(tokenizer, pairs)
    return sft_tokens(model, tokenizer.pad_token_id, ids, mask, schedule)


def sft_tokens(model, pad_id: int, ids: torch.Tensor, mask: torch.Tensor, schedule: SFTSchedule) -> list[float]:
    """sft on token ids (N, L), right-padded with pad_id, and a loss mask (N, L-1) over the targets
    ids[:, 1:]: for demonstrations built as token ids (multi-turn transcripts)."""
    steps, stop = schedule.steps, schedule.stop
    attention = (ids != pad_id).long()
    attention[:, 0] = 1
    g = torch.Generator().manual_seed(schedule.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=schedule.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / max(steps, 1))
    model.train()
    losses, start = [], time.time()
    for step in range(steps):
        rows = torch.randint(0, len(ids), (schedule.batch_size,), generator=g)
        logits = model(input_ids=ids[rows], attention_mask=attention[rows]).logits[:, :-1]
        loss = -A.masked_mean(logprobs_from_logits(logits, ids[rows, 1:]), mask[rows])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if schedule.log_every and (step + 1) % schedule.log_every == 0:
            print(f"sft step {step + 1}/{steps}  loss {loss.item():.4f}  {time.time() - start:.0f}s", flush=True)
        if stop is not None and (step + 1) % schedule.check_every == 0:
            model.eval()
            done = stop()
            model.train()
            if done:
                break
    model.eval()
    return losses


@torch.no_grad()
def greedy_accuracy(model, tokenizer, examples: list[dict], max_new_tokens: int = 6) -> float:
    """Share of examples whose greedy completion's number equals the answer."""
    from reward_service.rules import math_answer

    texts = complete(model, tokenizer, [e["prompt"] for e in examples], max_new_tokens)
    return sum(math_answer(t, e["answer"]) or 0.0 for t, e in zip(texts, examples)) / len(examples)


def complete(model, tokenizer, prompts: list[str], max_new_tokens: int, temperature: float = 0.0) -> list[str]:
    """One completion per text prompt: greedy at temperature 0, else sampled (from torch's global generator:
    seed it, or fork it, around the call). Prompts get the tokenizer's default special tokens, as in rollout."""
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        enc = tokenizer(prompts, return_tensors="pt", padding=True)
    finally:
        tokenizer.padding_side = side
    sample = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else {}
    with torch.no_grad():
        out = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **(sample or dict(do_sample=False)),
        )
    return tokenizer.batch_decode(out[:, enc.input_ids.shape[1] :], skip_special_tokens=True)


def sample_answers(model_dir: str, prompts: list[str], n: int, seed: int, max_new_tokens: int = 8) -> list[list[str]]:
    """n sampled completions (temperature 1, no top-k/top-p) of each prompt by the model in model_dir, in
    batches, on a torch generator seeded with `seed` (forked: the caller's stream is left as it was)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    flat = [p for p in prompts for _ in range(n)]
    texts: list[str] = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for i in range(0, len(flat), 1024):
            texts += complete(model, tokenizer, flat[i : i + 1024], max_new_tokens, temperature=1.0)
    return [texts[i * n : (i + 1) * n] for i in range(len(prompts))]

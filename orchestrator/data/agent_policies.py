"""Tiny starting policies for the built-in environments (envs/builtin.py), built like
tiny-addition-gpt: a tiny GPT trained from scratch by SFT, to partial skill, so RL has room.

Demonstrations are laid out token for token as rollout/episodes.py plays an episode (model turns
closed by EOS, observations through the chat template), and only the model's tokens are trained on.
- tiny-calculator-gpt: 3-digit sums, answered directly (which a tiny model does poorly) or, in a
  `tool_rate` share of demonstrations, by calling the calculator and copying its result;
- tiny-guess-gpt: guess_number played by guessing at random among the numbers still possible.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

import torch

from learner.sft import SFTSchedule, sft_tokens
from learner.tiny_gpt import init_tiny_gpt
from orchestrator.data.tasks import draw_task
from rollout.episodes import observation_ids
from runtime.prompts import encode_text


def transcript(tokenizer, prompt: str, turns: list[str]) -> tuple[list[int], list[int]]:
    """(token ids, 1 where the model acts) of an episode whose turns alternate model, observation, ..."""
    ids = encode_text(tokenizer, prompt)
    acts = [0] * len(ids)
    for k, text in enumerate(turns):
        if k % 2 == 0:
            tokens = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        else:
            tokens = observation_ids(tokenizer, text, "user", tokenizer.eos_token_id)
        ids += tokens
        acts += [1 - k % 2] * len(tokens)
    return ids, acts


def calculator_turns(example: dict, rng: random.Random, tool_rate: float = 0.25) -> list[str]:
    a, b = example["prompt"].rstrip("=").split("+")
    return [f"call {a}+{b}", example["answer"], example["answer"]] if rng.random() < tool_rate else [example["answer"]]


def guess_turns(example: dict, rng: random.Random, low: int = 1, high: int = 15, max_turns: int = 4) -> list[str]:
    secret, turns = int(example["answer"]), []
    for turn in range(max_turns):
        guess = rng.randint(low, high)
        turns.append(str(guess))
        if guess == secret or turn == max_turns - 1:
            break
        turns.append("higher" if guess < secret else "lower")
        low, high = (guess + 1, high) if guess < secret else (low, guess - 1)
    return turns


AGENTS = {
    "tiny-calculator-gpt": ("addition_3digit", calculator_turns, 800),
    "tiny-guess-gpt": ("guess_number", guess_turns, 600),
}


def agent_examples(name: str, seed: int) -> list[dict]:
    """The task examples agent `name` is trained on: trainable prompts only, never a run's held-out
    one (tasks.reserved; guess_number, one prompt, reserves none)."""
    return draw_task(AGENTS[name][0], 5000, seed + 1, held_out=False)


def build_tiny_agent(out: Path, name: str, seed: int = 0) -> Path:
    """Train `name` (a key of AGENTS) for its fixed number of SFT steps and save it in `out`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    task, turns_of, steps = AGENTS[name]
    torch.manual_seed(seed)
    start, rng = time.time(), random.Random(seed)
    print(
        f"relay: building the starting policy {out} (SFT from scratch on {task} episodes, {steps} steps)...", flush=True
    )
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    init_tiny_gpt(tmp, n_layer=2, n_embd=128, n_head=4, n_positions=128, seed=seed)
    model, tok = AutoModelForCausalLM.from_pretrained(tmp), AutoTokenizer.from_pretrained(tmp)
    rows = [transcript(tok, e["prompt"], turns_of(e, rng)) for e in agent_examples(name, seed)]
    L = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), L), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(rows), L - 1)
    for i, (r, acts) in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r) - 1] = torch.tensor(acts[1:], dtype=torch.float32)  # targets ids[:, 1:] the model produced
    losses = sft_tokens(model, tok.pad_token_id, ids, mask, SFTSchedule(steps, seed=seed))
    model.save_pretrained(tmp, safe_serialization=True)
    (tmp / "relay_sft.json").write_text(json.dumps({"task": task, "steps": steps, "final_loss": losses[-1]}))
    tmp.rename(out)
    print(f"relay: starting policy ready in {time.time() - start:.0f}s (final SFT loss {losses[-1]:.3f})", flush=True)
    return out

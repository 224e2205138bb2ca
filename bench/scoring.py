"""Scoring throughput: reference logprobs, a reward model and a rule reward, samples/s.

    .venv/bin/python -m bench.scoring [--samples 256] [--response-tokens 32] [--repeats 5]

Tiny GPT-2 models (~10M parameters, the bench/rollout.py "10M" shape) on the CPU, float32,
micro-batches of 32; medians of the repeats. Prints a table and a final JSON line.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2ForSequenceClassification

from bench.algorithms import median_ms
from learner.tiny_gpt import char_tokenizer, init_tiny_gpt
from reward_service.config import RewardSource, SourceKind
from reward_service.reference import ReferenceModel
from reward_service.sources import build_source
from rollout.types import RolloutBatch

SHAPE = dict(n_embd=384, n_layer=5, n_head=6)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--response-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    B, T = args.samples, args.response_tokens
    prompts = torch.randint(3, 60, (B, 16), generator=g).tolist()
    responses = torch.randint(3, 60, (B, T), generator=g).tolist()
    tok = char_tokenizer()
    texts = tok.batch_decode(responses)
    batch = RolloutBatch(list(range(B)), prompts, responses, [[0.0] * T] * B, texts, ["length"] * B)
    with tempfile.TemporaryDirectory() as tmp:
        policy = init_tiny_gpt(Path(tmp) / "policy", n_positions=128, **SHAPE)
        rm_path = Path(tmp) / "rm"
        GPT2ForSequenceClassification(GPT2Config(vocab_size=len(tok), n_positions=128, num_labels=1,
                                                 pad_token_id=tok.pad_token_id, **SHAPE)).save_pretrained(rm_path)
        tok.save_pretrained(rm_path)
        ref = ReferenceModel(str(policy), micro_batch_size=32)
        rm = build_source(RewardSource(kind=SourceKind.reward_model, model_path=str(rm_path)), micro_batch_size=32)
        rule = build_source(RewardSource(kind=SourceKind.math_answer))
        prompt_texts = tok.batch_decode(prompts)
        meta = [{"answer": "42"}] * B
        results = {
            "reference_samples_per_s": B / (1e-3 * median_ms(lambda: ref.logprobs(batch), args.repeats)),
            "reward_model_samples_per_s": B / (1e-3 * median_ms(lambda: rm.score(prompt_texts, texts, meta), args.repeats)),
            "math_rule_samples_per_s": B / (1e-3 * median_ms(lambda: rule.score(prompt_texts, texts, meta), args.repeats)),
        }
    for k, v in results.items():
        print(f"{k:28s} {v:12.1f}")
    print(json.dumps({"samples": B, "prompt_tokens": 16, "response_tokens": T, "params_m": 9.0,
                      "threads": torch.get_num_threads(), **{k: round(v, 1) for k, v in results.items()}}))


if __name__ == "__main__":
    main()

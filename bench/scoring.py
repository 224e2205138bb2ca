"""Scoring throughput: reference logprobs, a reward model and a rule reward, samples/s.

    .venv/bin/python -m bench.scoring [--samples 256] [--response-tokens 32] [--repeats 5]
    .venv/bin/python -m bench.scoring --deadlines [--repeats 5]
    .venv/bin/python -m bench.scoring --rules [--samples 512] [--repeats 5]

Tiny GPT-2 models (~10M parameters, the bench/rollout.py "10M" shape) on the CPU, float32,
micro-batches of 32; medians of the repeats. Prints a table and a final JSON line.
--deadlines instead measures what a source that never answers costs against its deadline; --rules
times `math_answer` (math-verify) on plain integers (the fast path), LaTeX and GSM8K-style prose.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import threading
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2ForSequenceClassification

from bench.algorithms import median_ms
from learner.tiny_gpt import char_tokenizer, init_tiny_gpt
from reward_service.combine import run_source
from reward_service.config import RewardSource, SourceKind
from reward_service.reference import ReferenceModel
from reward_service.remote import RemoteReward, serve
from reward_service.sources import build_source
from rollout.types import RolloutBatch

SHAPE = dict(n_embd=384, n_layer=5, n_head=6)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--response-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--deadlines", action="store_true", help="only the deadline overhead figures (no models)")
    p.add_argument("--rules", action="store_true", help="only math_answer's cost per answer style (no models)")
    args = p.parse_args()
    if args.deadlines:
        deadline_overhead(args.repeats)
        return
    if args.rules:
        rule_costs(args.samples, args.repeats)
        return
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
        GPT2ForSequenceClassification(
            GPT2Config(vocab_size=len(tok), n_positions=128, num_labels=1, pad_token_id=tok.pad_token_id, **SHAPE)
        ).save_pretrained(rm_path)
        tok.save_pretrained(rm_path)
        ref = ReferenceModel(str(policy), micro_batch_size=32)
        rm = build_source(RewardSource(kind=SourceKind.reward_model, model_path=str(rm_path)), micro_batch_size=32)
        rule = build_source(RewardSource(kind=SourceKind.math_answer))
        prompt_texts = tok.batch_decode(prompts)
        meta = [{"answer": "42"}] * B
        results = {
            "reference_samples_per_s": B / (1e-3 * median_ms(lambda: ref.logprobs(batch), args.repeats)),
            "reward_model_samples_per_s": B
            / (1e-3 * median_ms(lambda: rm.score(prompt_texts, texts, meta), args.repeats)),
            "math_rule_samples_per_s": B
            / (1e-3 * median_ms(lambda: rule.score(prompt_texts, texts, meta), args.repeats)),
        }
    for k, v in results.items():
        print(f"{k:28s} {v:12.1f}")
    print(
        json.dumps(
            {
                "samples": B,
                "prompt_tokens": 16,
                "response_tokens": T,
                "params_m": 9.0,
                "threads": torch.get_num_threads(),
                **{k: round(v, 1) for k, v in results.items()},
            }
        )
    )


def rule_costs(n: int, repeats: int) -> dict[str, float]:
    """Milliseconds to score n answers with math_answer, by style, after one untimed pass."""
    from reward_service.rules import math_answer

    rng = torch.Generator().manual_seed(0)
    nums = torch.randint(10, 999, (n, 2), generator=rng).tolist()
    styles = {
        "plain_int": [(str(a + b), str(a + b)) for a, b in nums],
        "latex_frac": [
            (f"so the answer is $\\boxed{{\\frac{{{a}}}{{{b}}}}}$.", f"\\frac{{{a}}}{{{b}}}") for a, b in nums
        ],
        "gsm8k_prose": [
            (f"{a} apples and {b} more, so {a} + {b} = {a + b} apples in all.", f"... #### {a + b}") for a, b in nums
        ],
    }
    results = {}
    for name, pairs in styles.items():
        score = lambda pairs=pairs: [math_answer(r, ref) for r, ref in pairs]  # noqa: E731
        score()
        results[f"{name}_ms"] = median_ms(score, repeats)
    for k, v in results.items():
        print(f"{k:28s} {v:12.1f}")
    print(json.dumps({"answers": n, "repeats": repeats, **{k: round(v, 1) for k, v in results.items()}}))
    return results


def deadline_overhead(repeats: int, timeout_s: float = 0.2) -> dict[str, float]:
    """Median wall time of a call to a source that never answers, next to the time it is allowed:
    a user function cut by run_source's deadline, and a loopback server cut by RemoteReward's
    per-attempt timeouts (1 retry). The hanging work blocks on an Event set after each call, so
    no thread outlives a repeat (the bound only guards against a client that never returns)."""
    release = threading.Event()
    logging.getLogger("reward_service.remote").setLevel(logging.ERROR)  # every late answer warns, by design

    class Hangs:
        def score(self, prompts, responses, metadata):
            release.wait(60)
            return [1.0] * len(responses)

    server = serve(lambda p, r, m: [1.0] * len(r) if release.wait(60) else [], port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    remote = RemoteReward(f"http://127.0.0.1:{server.server_address[1]}/score", timeout_s, 1, 2)
    batch = (["p"] * 8, ["r"] * 8, [{}] * 8)

    def unanswered(call):
        release.clear()
        call()
        release.set()

    try:
        fn_ms = median_ms(lambda: unanswered(lambda: run_source(Hangs(), *batch, timeout_s)), repeats)
        remote_ms = median_ms(lambda: unanswered(lambda: remote.score(*batch)), repeats)
    finally:
        release.set()
        server.shutdown()
        server.server_close()
    allowed_remote_ms = 1e3 * (2 * timeout_s + remote.backoff_s)  # 2 attempts and one backoff sleep
    results = {
        "function_ms": fn_ms,
        "function_allowed_ms": 1e3 * timeout_s,
        "remote_ms": remote_ms,
        "remote_allowed_ms": allowed_remote_ms,
        "remote_hard_deadline_ms": 1e3 * remote.deadline_s,
    }
    for k, v in results.items():
        print(f"{k:28s} {v:12.1f}")
    print(json.dumps({"timeout_s": timeout_s, "repeats": repeats, **{k: round(v, 1) for k, v in results.items()}}))
    return results


if __name__ == "__main__":
    main()

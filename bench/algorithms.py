"""Cost of the math core per training step, on shapes of a real batch.

    .venv/bin/python -m bench.algorithms [--batch 256] [--tokens 512] [--repeats 20]

Prints medians (ms) and a final JSON line. The GAE scan is a Python loop over tokens; this tells
whether it matters next to a model forward (it should stay well under one).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from learner import algorithms as A
from learner import losses as L


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    B, T = args.batch, args.tokens
    g = torch.Generator().manual_seed(0)
    r, v, lp, old = (torch.randn(B, T, generator=g) for _ in range(4))
    mask = (torch.arange(T) < torch.randint(T // 4, T + 1, (B, 1), generator=g)).float()
    scores = torch.randn(B, generator=g)
    results = {
        "compute_gae_ms": median_ms(lambda: A.compute_gae(r, v, mask, 1.0, 0.95), args.repeats),
        "kl_k3_ms": median_ms(lambda: A.kl_penalty(lp, old, "k3", mask), args.repeats),
        "token_rewards_ms": median_ms(lambda: A.token_rewards(scores, r, 0.05, mask), args.repeats),
        "grpo_ms": median_ms(lambda: A.grpo_advantages(scores, 8), args.repeats),
        "reinforce_pp_ms": median_ms(
            lambda: A.masked_whiten(A.reinforce_pp_returns(scores, r, 0.05, mask, 1.0, 8, group_baseline=True), mask),
            args.repeats,
        ),
        "ppo_policy_loss_ms": median_ms(
            lambda: A.ppo_policy_loss(A.PolicyLossInput(lp, old, r, mask), 0.2), args.repeats
        ),
        "gspo_policy_loss_ms": median_ms(
            lambda: L.gspo_policy_loss(A.PolicyLossInput(lp, old, r, mask, "seq_mean"), 3e-4, 4e-4), args.repeats
        ),
        "cispo_policy_loss_ms": median_ms(
            lambda: L.cispo_policy_loss(A.PolicyLossInput(lp, old, r, mask), None, 0.28), args.repeats
        ),
        "seq_sum_norm_ms": median_ms(lambda: A.aggregate(r, mask, "seq_sum_norm", norm_tokens=T), args.repeats),
        "ppo_value_loss_ms": median_ms(lambda: A.ppo_value_loss(v, old, r, mask, 0.2), args.repeats),
        "masked_whiten_ms": median_ms(lambda: A.masked_whiten(r, mask), args.repeats),
    }
    for k, ms in results.items():
        print(f"{k:24s} {ms:8.3f}")
    print(
        json.dumps(
            {
                "batch": B,
                "tokens": T,
                "threads": torch.get_num_threads(),
                **{k: round(x, 3) for k, x in results.items()},
            }
        )
    )


if __name__ == "__main__":
    main()

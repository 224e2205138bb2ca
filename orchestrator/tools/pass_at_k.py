"""pass@k, maj@k and avg@n over n samples per held-out prompt: pure functions, one implementation for the
trainer's evaluations and `relay eval`.

- pass@k: the chance that at least one of k samples drawn without replacement from a prompt's n is correct,
  by the unbiased estimator of Chen et al. 2021 (Codex), 1 - C(n-c, k) / C(n, k), averaged over prompts.
- maj@k (k >= 2): the majority vote of a prompt's first k samples (the samples are i.i.d., so the first k are an
  unbiased draw of k) over their answers as the grader reads them, grouped by its equivalence (`same`; per
  source kind: evaluate.VOTES); correct if the winning answer is. Ties: among answers with the most votes, the
  one sampled first wins.
- avg@n: the mean correctness over all n samples (pass@1's estimate, reported with every n).

A sample that could not be judged (an infra failure, never a wrong answer) is left out: a prompt counts with
the n of its judged samples, and a prompt with fewer than k judged samples is left out of pass@k and maj@k.
Every figure comes with its standard error over prompts (the sample standard deviation / sqrt(prompts)).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k) for c correct of n samples, as a product (no huge binomials)."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 < k <= n and 0 <= c <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def majority_correct(answers: list[str], correct: list[bool], same: Callable[[str, str], bool]) -> bool:
    """Whether the majority answer of `answers` is correct: answers grouped by `same` (each joins the
    first earlier group it matches), the biggest group winning, ties to the group sampled first."""
    groups: list[list[int]] = []  # sample indices, each group led by its first sample
    for i, answer in enumerate(answers):
        home = next((g for g in groups if same(answers[g[0]], answer)), None)
        if home is None:
            groups.append([i])
        else:
            home.append(i)
    winner = max(groups, key=len)  # max keeps the first of equal lengths: the earliest-sampled group
    return correct[winner[0]]


def mean_and_se(values: list[float]) -> tuple[float, float]:
    """The mean and its standard error over the values; (nan, nan) without values, se nan with one."""
    if not values:
        return float("nan"), float("nan")
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan")  # one: unknown
    return statistics.fmean(values), se


def sample_metrics(
    prompts: list[tuple[list[bool], list[str]]], n: int, ks: list[int], same: Callable[[str, str], bool] | None
) -> dict[str, float]:
    """pass@k and maj@k for each k of `ks`, and avg@n (n: the samples asked per prompt), each with `/se`,
    over prompts given as (correct, answers) of their judged samples in sampling order; `prompts_judged`:
    the prompts with a judged sample. `same` None: no answers to vote on, no maj@k."""
    judged = [(c, a) for c, a in prompts if c]
    out: dict[str, float] = {}
    out[f"avg@{n}"], out[f"avg@{n}/se"] = mean_and_se([sum(c) / len(c) for c, _ in judged])
    for k in ks:
        full = [(c, a) for c, a in judged if len(c) >= k]
        out[f"pass@{k}"], out[f"pass@{k}/se"] = mean_and_se([pass_at_k(len(c), sum(c), k) for c, _ in full])
        if (
            k > 1 and same is not None
        ):  # a vote of one is the first sample's correctness: pass@1 estimates that with all n
            votes = [float(majority_correct(a[:k], c[:k], same)) for c, a in full]
            out[f"maj@{k}"], out[f"maj@{k}/se"] = mean_and_se(votes)
    out["prompts_judged"] = float(len(judged))
    return out

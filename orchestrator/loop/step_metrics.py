"""What the loop reads off each step: batch and reward statistics, staleness and busy shares, the phase
timer, and the checks that stop a run that cannot learn."""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from pathlib import Path

from reward_service.types import ScoredBatch
from rollout.types import RolloutBatch
from runtime import watchdog
from runtime.prompts import is_chat, is_token_ids

VERIFIABLE = ("math_answer", "exact_match", "reasoning_gym", "environment")  # sources whose mean is an accuracy


def staleness_metrics(
    versions: list[int], step: int, lead: int, token_versions: list[int] = (), last: list[int] = ()
) -> dict[str, float]:
    """How many policy versions behind the learner (at `step`) each sample's first token was: mean,
    max and the share at each staleness 0..lead (the histogram; lead is the bound); the same per
    model-sampled token (`token_versions`, one per token of the batch: in_flight mixes versions in a
    sample); and the share of samples whose last token (`last`) came from a later version than their first."""
    ages = [step - v for v in versions]
    m = {"async/staleness_mean": statistics.fmean(ages), "async/staleness_max": float(max(ages))}
    m.update({f"async/staleness_{k}": sum(a == k for a in ages) / len(ages) for k in range(lead + 1)})
    if token_versions:
        token_ages = [step - v for v in token_versions]
        m["async/token_staleness_mean"] = statistics.fmean(token_ages)
        m["async/token_staleness_max"] = float(max(token_ages))
    if last:
        m["async/mixed_version_frac"] = sum(a != b for a, b in zip(versions, last)) / len(last)
    return m


def batch_staleness(batch: RolloutBatch, step: int, lead: int) -> dict[str, float]:
    """staleness_metrics of a batch's samples and of its model-sampled tokens, at `step` under bound `lead`."""
    return staleness_metrics(batch.version_first, step, lead, batch.model_token_versions(), batch.version_last)


def throughput_metrics(batch: RolloutBatch, wall: float) -> dict[str, float]:
    """Samples and tokens per second of a step taking `wall` seconds: the tokens the model sampled (an
    episode's observation tokens are not generated)."""
    return {"throughput/tokens_per_s": sum(batch.model_lengths) / wall, "throughput/samples_per_s": len(batch) / wall}


def busy_metrics(
    timings: dict[str, float], before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
) -> dict[str, float]:
    """Each role's busy share of the step (the rest it waited): the engines' and the scoring
    service's own working time, read from them (`before`/`after`: seconds by role, by actor; an actor
    restarted in the step counts from its restart), averaged over the actors at the step's end (an engine
    that joined in the step counts from its start), and the learner's two phases (advantages and update)."""

    def worked(role: str, actor: str, b: float) -> float:
        a = before[role].get(actor, 0.0)
        return max(0.0, b - a) if b >= a else b

    wall = timings["timing/total"]
    busy = {
        role: min(statistics.fmean(worked(role, k, b) for k, b in after[role].items()) / wall, 1.0)
        for role in ("rollout", "scoring")
    } | {"learner": (timings["timing/advantages"] + timings["timing/update"]) / wall}
    return {f"pipeline/busy/{k}": v for k, v in busy.items()} | {f"pipeline/idle/{k}": 1.0 - v for k, v in busy.items()}


@contextmanager
def timed(timings: dict[str, float], name: str):
    """Time the block as timing/<name>, and watch its remote calls under the phase's deadline
    (runtime/watchdog.py; "total" is the whole step's)."""
    start = time.perf_counter()
    try:
        with watchdog.phase("step" if name == "total" else name):
            yield
    finally:
        timings[f"timing/{name}"] = time.perf_counter() - start


def quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def reward_stats(r: list[float]) -> dict[str, float]:
    """reward/mean, std, min, max and quantiles of `r`; all NaN when no sample could be judged."""
    if not r:
        return {f"reward/{k}": float("nan") for k in ("mean", "std", "min", "max", "p10", "p50", "p90")}
    return {
        "reward/mean": statistics.fmean(r),
        "reward/std": statistics.pstdev(r),
        "reward/min": min(r),
        "reward/max": max(r),
        "reward/p10": quantile(r, 0.1),
        "reward/p50": quantile(r, 0.5),
        "reward/p90": quantile(r, 0.9),
    }


def reward_metrics(scored: ScoredBatch) -> dict[str, float]:
    """The reward of a scored batch, one implementation for training (reward/*) and evaluation
    (eval/*/reward/*). Statistics of the raw reward (the sources' weighted sum; not the shaped one,
    whose batch normalisation makes a mean of 0) and the accuracy of the first verifiable source,
    both over the same samples: those every source that trains could judge (the rest counted as
    reward/invalid_frac). Each source's mean and invalid fraction over the batch (a weight-0 source's
    failures are its own), and the scoring calls' counts."""
    judged = [not bad for bad in scored.invalid]
    m = reward_stats([x for x, ok in zip(scored.raw, judged) if ok])
    m["reward/invalid_frac"] = 1 - sum(judged) / max(len(judged), 1)
    for name, scores in scored.components.items():
        good = [s for s in scores if s == s]  # not NaN
        m[f"reward/{name}/mean"] = statistics.fmean(good) if good else float("nan")
        m[f"reward/{name}/invalid_frac"] = 1 - len(good) / max(len(scores), 1)
        right = [s for s, ok in zip(scores, judged) if ok and s == s]
        if name.startswith(VERIFIABLE) and right:
            m.setdefault("reward/accuracy", statistics.fmean(right))
    return m | scored.metrics


def distinct_n(sequences: list[list[int]], n: int) -> float:
    """Distinct n-grams over all n-grams of the responses (Li et al. 2016); 0 when there are none."""
    grams = [tuple(s[i : i + n]) for s in sequences for i in range(len(s) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def zero_spread_share(prompt_index: list[int], scored: ScoredBatch) -> float:
    """The share of prompt groups (two or more judged samples) whose raw rewards are all equal: a GRPO
    or RLOO group like that has zero advantage, no signal; NaN without such groups (one sample a prompt)."""
    groups: dict[int, set[float]] = {}
    sizes: dict[int, int] = {}
    for j, r, bad in zip(prompt_index, scored.raw, scored.invalid):
        if not bad:
            groups.setdefault(j, set()).add(r)
            sizes[j] = sizes.get(j, 0) + 1
    grouped = [j for j in groups if sizes[j] >= 2]
    return sum(len(groups[j]) == 1 for j in grouped) / len(grouped) if grouped else float("nan")


def batch_metrics(batch: RolloutBatch, scored: ScoredBatch, prefix: str = "") -> dict[str, float]:
    """What a practitioner watches for reward hacking, collapse and instability, from the batch that
    trains: its reward (reward_metrics), the samples dropped (reward.invalid: drop) with the groups
    left with fewer than 2 samples, lengths in model tokens, and an episode's environment."""
    lengths = batch.model_lengths  # the model's tokens: an episode's observations are not its response
    kept = {}
    for j, keep in zip(batch.prompt_index, scored.valid):
        kept[j] = kept.get(j, 0) + keep
    m = {
        "reward/dropped_samples": float(len(scored.valid) - sum(scored.valid)),
        "reward/dropped_groups": float(sum(n < 2 for n in kept.values())) if len(batch) > len(kept) else 0.0,
        **reward_metrics(scored),
        "reward/zero_spread_groups": zero_spread_share(batch.prompt_index, scored),
        "response/length_mean": statistics.fmean(lengths),
        "response/distinct_2": distinct_n(batch.model_ids, 2),
        "response/length_max": float(max(lengths)),
        # the token budget ran out, not the turns
        "response/clipped_frac": sum(f == "length" for f in batch.finish_reason) / len(batch),
        "rollout/skipped_prompts": float(len(batch.skipped)),
    }
    if batch.env_return:
        m.update(episode_metrics(batch))
    return {prefix + k: v for k, v in m.items()}


def episode_metrics(batch: RolloutBatch) -> dict[str, float]:
    """Multi-turn episodes: the environment's return and turns, and its failures, counted."""
    returns = [r for r in batch.env_return if r is not None] or [float("nan")]
    observed = sum(len(m) - sum(m) for m in batch.action_mask)
    return {
        "env/return_mean": statistics.fmean(returns),
        "env/turns_mean": statistics.fmean(batch.turns),
        "env/timeouts": float(batch.env_failure.count("timeout")),
        "env/errors": float(batch.env_failure.count("error")),
        # a turn cut at max_new_tokens inside an episode that went on: response/clipped_frac misses it
        "response/clipped_turn_frac": sum(batch.clipped_turns) / max(sum(batch.turns), 1),
        "env/observation_token_frac": observed / max(sum(batch.response_lengths), 1),
    }


def prompt_text(prompt) -> str:
    """A prompt for display: chat messages as their last message's content, token ids as numbers
    (no tokenizer here to decode them)."""
    if is_chat(prompt):
        return prompt[-1]["content"]
    if is_token_ids(prompt):
        return "token ids: " + " ".join(map(str, prompt))
    return str(prompt)


class TrainingError(RuntimeError):
    """The run cannot usefully continue; the message names the cause."""


NONFINITE_CAUSES = {
    "old_logprobs": "the learner's log-probabilities of the sampled tokens (a sampling temperature of 0, or a "
    "model whose logits overflow in this dtype)",
    "ref_logprobs": "the reference model's log-probabilities of the sampled tokens",
    "advantages": "the advantages (a NaN or infinite reward, or a non-finite critic value)",
    "old_values": "the critic's values",
    "returns": "the value targets (rewards or critic values)",
}


def nonfinite_cause(stats: dict[str, float]) -> str:
    found = [name for name in NONFINITE_CAUSES if f"learner/nonfinite/{name}" in stats]  # present only when non-finite
    if found:
        return "non-finite: " + "; ".join(NONFINITE_CAUSES[n] for n in found)
    return "the inputs were finite, so the loss or its gradients overflowed: lower learner.lr, or set learner.grad_clip"


def check_progress(
    counters: dict, stats: dict[str, float], scored: ScoredBatch, max_skipped: int, max_unjudged: int, step: int
) -> None:
    """Stop the run (TrainingError) once it cannot learn: more than `max_skipped`
    (algorithm.max_skipped_updates) updates in a row skipped for non-finite values, or `max_unjudged`
    (reward.max_unjudged_steps) steps in a row in which no sample could be judged (a reward source
    or environment that is down: nothing trains under invalid: drop, only zeros under zero). Going on
    would only spend compute. 0: never. The counts in a row are in `counters` (checkpointed)."""
    skipped = stats["learner/skipped_steps"] > 0 or stats["learner/nonfinite_losses"] > 0
    key = "learner/skipped_updates_in_a_row"
    in_a_row = counters[key] = counters[key] + 1 if skipped else 0
    if max_skipped and in_a_row > max_skipped:
        raise TrainingError(
            f"step {step}: {in_a_row} updates in a row were skipped for non-finite values "
            f"(algorithm.max_skipped_updates: {max_skipped}); {nonfinite_cause(stats)}"
        )
    key = "reward/unjudged_steps_in_a_row"
    in_a_row = counters[key] = counters[key] + 1 if scored.invalid and all(scored.invalid) else 0
    if max_unjudged and in_a_row >= max_unjudged:
        raise TrainingError(
            f"step {step}: no sample could be judged in {in_a_row} steps in a row "
            f"(reward.max_unjudged_steps: {max_unjudged}); {unjudged_cause(scored)}"
        )


def unjudged_cause(scored: ScoredBatch) -> str:
    """The sources that failed in the last step's batch, each with its first error."""
    failed = [name for name, scores in scored.components.items() if any(s != s for s in scores)]
    return (
        "; ".join(
            f"{name} failed on {sum(s != s for s in scored.components[name])} of {len(scored.invalid)} "
            f"samples: {scored.errors.get(name, 'no error raised (a None or NaN score, or a failed episode)')}"
            for name in failed
        )
        or "no source reported a failure"
    )


def finished_before(run_dir: Path, resumed_at: int | None, total_steps: int) -> bool:
    """A resumed run whose earlier run also evaluated after its last step (eval_after.json; a fresh
    run removes an earlier one's): its final rows are logged already, so it is not evaluated again."""
    return resumed_at is not None and resumed_at >= total_steps and (run_dir / "eval_after.json").exists()

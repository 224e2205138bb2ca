"""Dynamic sampling (DAPO) as pure functions over named groups: a group whose samples are all right
or all wrong teaches a group baseline nothing, so it is replaced with fresh prompts' groups, for a few
rounds. Right or wrong is the raw reward (DAPO's accuracy, Yu et al. 2025, Eq. 11: keep a group iff
0 < #correct < G), never the shaped one: the overlong penalty alone would keep an all-correct group
with one long sample and train it on length. Under reward.normalization: batch the kept groups of
every round are normalised once, together (reward_service.shaping.renormalised)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from reward_service.shaping import renormalised
from reward_service.types import ScoredBatch
from rollout.types import RolloutBatch


@dataclass
class Group:
    """One prompt's samples, their scores, the prompt's example, and whether their raw rewards differ."""

    rollouts: RolloutBatch
    scored: ScoredBatch
    example: dict
    informative: bool


@dataclass
class Sampled:
    """A batch, the examples its prompt indices point into, and its scores."""

    rollouts: RolloutBatch
    examples: list[dict]
    scored: ScoredBatch


def informative(rewards: list[float], valid: list[bool]) -> bool:
    """A group teaches a group baseline something only if the (raw) rewards of the samples that train
    differ: a dropped sample (invalid: drop) is no part of its group."""
    return len({r for r, keep in zip(rewards, valid) if keep}) > 1


def accuracy(scored: ScoredBatch) -> list[float]:
    """Each sample's raw reward, before any shaping; one nobody judged that still trains (invalid:
    zero) is a wrong answer, 0, as it trains."""
    return [0.0 if bad else r for r, bad in zip(scored.raw, scored.invalid)]


def groups_of(sampled: Sampled) -> list[Group]:
    """The batch's groups in prompt order (a prompt the engine skipped has none)."""
    groups = []
    for j, example in enumerate(sampled.examples):
        rows = [i for i, p in enumerate(sampled.rollouts.prompt_index) if p == j]
        if rows:
            kept = sampled.scored.select(rows)
            groups.append(Group(sampled.rollouts.select(rows), kept, example, informative(accuracy(kept), kept.valid)))
    return groups


def pick_groups(groups: list[Group], want: int) -> tuple[list[Group], int]:
    """The `want` groups a dynamic-sampling step trains on, informative ones first, in the order
    generated, and how many generated groups it drops."""
    chosen = ([g for g in groups if g.informative] + [g for g in groups if not g.informative])[:want]
    return chosen, len(groups) - len(chosen)


def merge_groups(chosen: list[Group], skipped: list, calls: list[ScoredBatch]) -> Sampled:
    """One batch of the chosen groups, prompt j being the j-th group; `skipped`: every round's
    skipped prompts; `calls`: every round's scoring, whose counts the merged scores report. Batch-
    normalised rewards are normalised again over the chosen groups alone."""
    for j, group in enumerate(chosen):
        group.rollouts.prompt_index = [j] * len(group.rollouts)
    merged = RolloutBatch.concat([g.rollouts for g in chosen])
    merged.skipped = skipped
    scored = renormalised(ScoredBatch.concat([g.scored for g in chosen], calls))
    return Sampled(merged, [g.example for g in chosen], scored)


def dynamic_sample(
    first: Sampled, want: int, rounds: int, sample_more: Callable[[int], Sampled]
) -> tuple[Sampled, int]:
    """Keep `want` groups, informative first: while short of informative ones, `sample_more(n)` (n
    fresh prompts, generated and scored) for up to `rounds` extra rounds. If still short, equal
    groups fill the rest, so the batch keeps its shape. Returns the batch and the groups dropped."""
    groups, skipped, calls, sampled = [], list(first.rollouts.skipped), [first.scored], first
    for round_ in range(rounds + 1):
        groups += groups_of(sampled)
        have = sum(g.informative for g in groups)
        if have >= want or round_ == rounds:
            break
        sampled = sample_more(want - have)
        skipped, calls = skipped + sampled.rollouts.skipped, calls + [sampled.scored]
    chosen, dropped = pick_groups(groups, want)
    return merge_groups(chosen, skipped, calls), dropped

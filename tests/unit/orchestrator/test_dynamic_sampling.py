"""Dynamic sampling (orchestrator/loop/dynamic_sampling.py) on the real ScoringService (issue 40,
item 5): a group is kept on accuracy, 0 < #correct < G (DAPO, Eq. 11), never on the shaped reward;
and under reward.normalization: batch the groups kept from every round are normalised once, together.

Hand example for the normalisation. Round 1: group a ["2", "2"] (both right), group b ["2", "3"];
round 2: group c ["3", "2"]. Kept: b and c, raw [1, 0, 0, 1]: mean 1/2, unbiased std sqrt(1/3), so
[+-sqrt(3)/2] = [0.866025, -0.866025, -0.866025, 0.866025]. Each round by its own statistics gave b
[0.5, -1.5] (round 1 over [1, 1, 1, 0]) and c [-0.707107, 0.707107]: b's samples counted 2.3 times
c's, for no reason but the groups beside them."""

import pytest

from learner.tiny_gpt import char_tokenizer
from orchestrator.loop.dynamic_sampling import Sampled, dynamic_sample
from reward_service.config import Normalization, RewardConfig, RewardSource, SourceKind
from reward_service.service import ScoringService
from rollout.types import RolloutBatch

tok = char_tokenizer()
ROOT3_2 = 3**0.5 / 2


def groups(*responses: list[str]) -> RolloutBatch:
    """One group of samples per prompt, as the rollout returns them."""
    index = [j for j, group in enumerate(responses) for _ in group]
    texts = [x for group in responses for x in group]
    ids = [tok(x, add_special_tokens=False).input_ids for x in texts]
    n = len(texts)
    return RolloutBatch(index, [tok("1+1=").input_ids] * n, ids, [[-1.0] * len(r) for r in ids], texts, ["stop"] * n)


def scored(service: ScoringService, *responses: list[str]) -> Sampled:
    batch = groups(*responses)
    examples = [{"prompt": "1+1=", "answer": "2", "group": group} for group in responses]
    return Sampled(batch, examples, service.score(batch, [{"answer": "2"}] * len(responses)))


def service(tiny_model, **shaping) -> ScoringService:
    return ScoringService(RewardConfig(sources=[RewardSource(kind=SourceKind.math_answer)], **shaping), tiny_model)


def test_an_all_correct_group_with_one_overlong_sample_is_dropped_a_mixed_group_kept(tiny_model):
    # "so 2" is right and 4 tokens long: DAPO's overlong penalty (free up to 2 tokens, -1 at 4)
    # makes the shaped rewards [1, 0], which kept the group and trained it on length alone
    s = service(tiny_model, overlong_buffer=2, overlong_max_tokens=4)
    first = scored(s, ["2", "so 2"], ["2", "3"])
    assert first.scored.rewards == [1.0, 0.0, 1.0, 0.0] and first.scored.raw == [1.0, 1.0, 1.0, 0.0]
    kept, dropped = dynamic_sample(first, want=1, rounds=0, sample_more=None)
    assert [e["group"] for e in kept.examples] == [["2", "3"]] and dropped == 1
    assert kept.rollouts.response_text == ["2", "3"] and kept.scored.rewards == [1.0, 0.0]


def test_batch_normalisation_over_two_rounds_equals_normalising_the_kept_groups_at_once(tiny_model):
    s = service(tiny_model, normalization=Normalization.batch)
    first = scored(s, ["2", "2"], ["2", "3"])
    assert first.scored.rewards[2:] == pytest.approx([0.5, -1.5])  # round 1's own statistics
    asked = []

    def sample_more(n: int) -> Sampled:
        asked.append(n)
        return scored(s, ["3", "2"])

    kept, dropped = dynamic_sample(first, want=2, rounds=1, sample_more=sample_more)
    assert asked == [1] and dropped == 1 and kept.rollouts.response_text == ["2", "3", "3", "2"]
    assert kept.scored.rewards == pytest.approx([ROOT3_2, -ROOT3_2, -ROOT3_2, ROOT3_2])
    at_once = scored(s, ["2", "3"], ["3", "2"]).scored.rewards
    assert kept.scored.rewards == pytest.approx(at_once)

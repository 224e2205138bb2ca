"""The judge on its own frozen vLLM engine (the default for a model folder), inside the scoring service as a
Ray actor: its verdicts, greedy and by first-token probability, are those of the same model run by
transformers, and a filled template too long for the engine's context is left unjudged and counted, never
scored."""

import math

import pytest
import ray

from reward_service.config import Normalization, RewardConfig, RewardSource, SourceKind
from reward_service.service import ScoringService
from reward_service.sources import build_source
from tests.unit.reward_service.test_service import batch_of

# the template is the prompt: the tiny addition policy answers with its sum, read as a number in [0, 200]
JUDGE = dict(
    kind=SourceKind.judge,
    template="{prompt}",
    verdict="number",
    score_range=[0.0, 200.0],
    judge_max_tokens=4,
    judge_max_model_len=24,
    judge_chat_template=False,  # the tiny model's chat template ends a turn with a newline it never trained on
    timeout_s=300.0,
)
# the same model's first digit, read as a score: 1 -> 1, 4 -> 0.5, 9 -> 0, by its probability of each
PROBABILITY = JUDGE | dict(
    name="first_digit",
    verdict="probability",
    choices={"1": 1.0, "4": 0.5, "9": 0.0},
    judge_min_choice_mass=0.0,  # these three digits are not all of its mass: the ratio, compared exactly
    weight=0.0,
)
PROMPTS = ["12+34=", "37+18=", "55+44=", "61+27=", "1+" * 12 + "1="]  # the last: 26 characters, over 24 - 4


def test_a_vllm_judge_in_the_scoring_actor_gives_the_verdicts_of_transformers(ray_cluster, policy):
    sources = [RewardSource(model_path=policy, **JUDGE), RewardSource(model_path=policy, **PROBABILITY)]
    cfg = RewardConfig(sources=sources, micro_batch_size=8, normalization=Normalization.none)
    service = ray.remote(concurrency_groups={"stats": 1})(ScoringService).options(num_cpus=1).remote(cfg, policy)
    batch, meta = batch_of([(p, "x") for p in PROMPTS]), [{}] * len(PROMPTS)
    scored = ray.get(service.score.remote(batch, meta, 1.0))
    local = build_source(RewardSource(model_path=policy, judge_engine="transformers", **JUDGE), micro_batch_size=8)
    want = greedy = local.score(PROMPTS[:-1], ["x"] * 4, meta[:-1]).scores
    got = scored.components["judge"]
    assert all(w is not None for w in want) and len(set(want)) > 1  # four sums, read as four numbers
    assert got[:-1] == want and math.isnan(got[-1])
    assert math.isnan(scored.components["first_digit"][-1])
    assert scored.invalid == [False] * 4 + [True]
    m = scored.metrics  # summed over both sources: the long prompt is never sent, counted apart
    assert m["judge/judged"] == 8 and m["judge/too_long"] == 2 and m["judge/parse_failures"] == 0
    local = build_source(
        RewardSource(model_path=policy, judge_engine="transformers", **PROBABILITY), micro_batch_size=8
    )
    want = local.score(PROMPTS[:-1], ["x"] * 4, meta[:-1]).scores
    assert all(w is not None for w in want) and len(set(want)) > 1
    assert scored.components["first_digit"][:-1] == pytest.approx(want, abs=1e-4)
    again = ray.get(service.score.remote(batch, meta, 1.0))  # the frozen judge's verdicts, from its cache
    assert again.components["judge"][:-1] == greedy and again.metrics["judge/cache_hits"] == 10  # 5 per source
    ray.kill(service)

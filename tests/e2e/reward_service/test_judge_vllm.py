"""The judge on its own frozen vLLM engine (the default for a model folder), inside the scoring service as a
Ray actor: its verdicts are those of the same model run greedily by transformers, and a filled template too
long for the engine's context is left unjudged and counted, never scored."""

import math

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
PROMPTS = ["12+34=", "37+18=", "55+44=", "61+27=", "1+" * 12 + "1="]  # the last: 26 characters, over 24 - 4


def test_a_vllm_judge_in_the_scoring_actor_gives_the_verdicts_of_transformers(ray_cluster, policy):
    cfg = RewardConfig(
        sources=[RewardSource(model_path=policy, **JUDGE)], micro_batch_size=8, normalization=Normalization.none
    )
    service = ray.remote(concurrency_groups={"stats": 1})(ScoringService).options(num_cpus=1).remote(cfg, policy)
    batch, meta = batch_of([(p, "x") for p in PROMPTS]), [{}] * len(PROMPTS)
    scored = ray.get(service.score.remote(batch, meta, 1.0))
    local = build_source(RewardSource(model_path=policy, judge_engine="transformers", **JUDGE), micro_batch_size=8)
    want = local.score(PROMPTS[:-1], ["x"] * 4, meta[:-1]).scores
    got = scored.components["judge"]
    assert all(w is not None for w in want) and len(set(want)) > 1  # four sums, read as four numbers
    assert got[:-1] == want and math.isnan(got[-1])
    assert scored.invalid == [False] * 4 + [True]
    assert scored.metrics["judge/judged"] == 5 and scored.metrics["judge/parse_failures"] == 1
    again = ray.get(service.score.remote(batch, meta, 1.0))  # the frozen judge's verdicts, from its cache
    assert again.components["judge"][:-1] == want and again.metrics["judge/cache_hits"] == 5
    ray.kill(service)

"""The scoring service as a Ray actor, and the pool that finishes a batch judged ahead and rescores it
when the service died."""

import ray
import torch

from orchestrator.loop.step_metrics import batch_metrics
from reward_service.config import InvalidPolicy, Normalization, RewardConfig, RewardSource, SourceKind
from reward_service.reference import ReferenceModel
from reward_service.service import ScoringService
from runtime.forward import PolicyFunction
from tests.unit.reward_service.test_service import PAIRS, batch_of, same


def test_scoring_service_as_a_ray_actor(ray_cluster, tiny_model):
    cfg = RewardConfig(
        sources=[
            RewardSource(kind=SourceKind.math_answer),
            RewardSource(kind=SourceKind.format, pattern="^####", weight=0.5),
        ],
        invalid=InvalidPolicy.drop,
        normalization=Normalization.none,
        micro_batch_size=2,
    )
    service = ray.remote(concurrency_groups={"stats": 1})(ScoringService).options(num_cpus=1).remote(cfg, tiny_model)
    batch = batch_of(PAIRS)
    meta = [{"answer": "46"}, {"answer": "56"}, {}, {"answer": "5"}]
    scored = ray.get(service.score.remote(batch, meta, 1.0))
    # 46: math 1, no #### -> 1; "56 is the answer": last number 56 -> 1; no reference -> invalid; #### 5 -> 1.5
    assert scored.rewards == [1.0, 1.0, 0.0, 1.5]
    assert scored.invalid == [False, False, True, False] and scored.valid == [True, True, False, True]
    assert scored.components["format"] == [0.0, 0.0, 0.0, 1.0]
    assert scored.ref_logprobs == [[], [], [], []]  # the reference phase is a call of its own
    assert scored.metrics == {"reward/timeouts": 0.0, "reward/errors": 0.0, "reward/retried_attempts": 0.0}
    assert batch_metrics(batch, scored)["reward/invalid_frac"] == 0.25
    ref = ray.get(service.reference_logprobs.remote(batch, temperature=1.0))
    assert [len(x) for x in ref] == [len(r) for r in batch.response_ids]
    direct = ReferenceModel(tiny_model).logprobs(batch)
    assert all(torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5) for a, b in zip(ref, direct))
    ray.kill(service)


def killed(actor, instance: str, polls: int = 600) -> None:
    """Until the killed actor is gone: ray.kill only sends the kill, and under load the old actor could still
    answer the pool's next calls (CI, 2026-12-05: restarts 0). A call that fails or a new instance says so."""
    import time

    for _ in range(polls):
        try:
            if ray.get(actor.instance_id.remote()) != instance:
                return
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)
    raise AssertionError(f"the killed actor still answers after {polls} polls")


def test_the_pool_finishes_a_batch_judged_ahead_and_rescores_it_if_the_service_died(ray_cluster, tiny_model):
    from reward_service.pool import ScoringPool

    cfg = RewardConfig(sources=[RewardSource(kind=SourceKind.math_answer)], normalization=Normalization.running)
    pool = ScoringPool(cfg, tiny_model, PolicyFunction(chunk_tokens=4096), 1, {"num_cpus": 1, "max_restarts": 1})
    direct = ScoringService(cfg, tiny_model)
    batch, meta = batch_of(PAIRS), [{"answer": "46"}, {"answer": "56"}, {}, {"answer": "5"}]
    parts = [ray.put(batch.select([0, 1])), ray.put(batch.select([2, 3]))]  # as pending generate calls
    ahead = pool.judge_ahead(parts, meta, 1.0)
    assert same(pool.score(batch, meta, 1.0, ahead), direct.score(batch, meta))
    want = direct.reference_logprobs(batch)
    assert pool.reference(batch, 1.0, ahead) == want and pool.reference(batch, 1.0) == want
    assert pool.busy_seconds() > 0
    judged = pool.judge_ahead(parts, meta, 1.0)
    ray.get([judged.judged, judged.reference])
    ray.kill(pool.actor, no_restart=False)  # the judged batch died with the service: scored whole again
    killed(pool.actor, pool.instance)
    assert same(pool.score(batch, meta, 1.0, judged), direct.score(batch, meta)) and pool.restarts == 1
    # its reference call died with it too: computed again on the new actor, and the one death counted once
    assert pool.reference(batch, 1.0, judged) == want and pool.restarts == 1
    assert pool.state_dict() == direct.state_dict()
    pool.shutdown()

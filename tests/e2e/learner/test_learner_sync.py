"""The sending side of weight sync: learner ranks (ZeRO 0 and ZeRO-3 over 2 ranks) to real vLLM
engines through the WeightChannel and vLLM's weight-transfer API; and a learner checkpoint served by
vLLM as is."""

import pytest
import ray
import torch

from learner.config import AlgorithmConfig, Estimator, LearnerConfig
from learner.group import LearnerGroup, RankPlacement
from rollout.channel import WeightChannel
from rollout.config import RolloutConfig, SamplingConfig
from rollout.pool import PoolOptions, RolloutPool
from runtime.logprobs import SamplerSettings
from tests.helpers import make_scored_batch

pytestmark = pytest.mark.e2e
PROMPTS = ["12+34=", "7*8=", "hello"]


@pytest.fixture(scope="module")
def pool(ray_cluster, tiny_model):
    cfg = RolloutConfig(max_model_len=128, max_prompt_tokens=16, sampling=SamplingConfig(max_new_tokens=8))
    p = RolloutPool(cfg, tiny_model, num_workers=2, seed=0, options=PoolOptions(num_cpus=0))
    yield p
    p.shutdown()


def close_logprobs(a, b, tol=1e-4):
    return all(len(x) == len(y) and torch.allclose(torch.tensor(x), torch.tensor(y), atol=tol) for x, y in zip(a, b))


@pytest.mark.parametrize("world, zero", [(1, 0), (2, 3)])
def test_learner_weights_reach_every_engine(pool, tiny_model, world, zero):
    algo = AlgorithmConfig(estimator=Estimator.grpo, mini_batch_size=8, micro_batch_size=4)
    group = LearnerGroup(
        LearnerConfig(model_path=tiny_model, lr=5e-3, zero_stage=zero),
        algo,
        SamplerSettings(n_samples_per_prompt=4),
        world,
        seed=0,
        placement=RankPlacement(num_cpus=0, threads=1),
    )
    try:
        for step in range(2):  # move the policy away from the engines (other seeds than the other case)
            group.update(*make_scored_batch(tiny_model, seed=10 + step + 100 * zero), step=step)
        before = pool.generate(PROMPTS, step=0, greedy=True)
        assert not close_logprobs(before.logprobs, group.policy_logprobs(before))
        # the trainer's path: the channel joins rank 0 and the engines through vLLM's weight-transfer
        # API (relay's gloo engine on CPU) and sends in 1 MiB buckets, several per sync
        channel = WeightChannel(pool, group, bucket_mb=1, timeout_s=60)
        assert len(channel.buckets) > 1 and pool.sync_backend == "relay_gloo"
        channel.send(version=7)
        after = pool.generate(PROMPTS, step=0, greedy=True)
        assert close_logprobs(after.logprobs, group.policy_logprobs(after))
        # vLLM's own tag on every token (its weight_versions spans, set by AsyncLLM.update_weight_version)
        assert after.version_first == [7] * len(after) and all(set(v) == {7} for v in after.token_versions)
        channel.send(version=8)  # the second sync travels in the wire layout the first taught
        assert pool.generate(PROMPTS, step=0, greedy=True).response_ids == after.response_ids
        for w in pool.workers:  # every engine, not only the shards that generated above
            alone = ray.get(w.generate.remote(PROMPTS, 0, 0, True))
            assert alone.response_ids == after.response_ids
    finally:
        group.shutdown()


def test_a_learner_checkpoint_is_served_by_vllm_as_is(ray_cluster, tiny_model, tmp_path):
    algo = AlgorithmConfig(estimator=Estimator.grpo, mini_batch_size=8, micro_batch_size=4)
    group = LearnerGroup(
        LearnerConfig(model_path=tiny_model, lr=5e-3),
        algo,
        SamplerSettings(n_samples_per_prompt=4),
        1,
        seed=0,
        placement=RankPlacement(num_cpus=0, threads=1),
    )
    try:
        group.update(*make_scored_batch(tiny_model, seed=20), step=0)
        ckpt = group.save(tmp_path / "ckpt")
        cfg = RolloutConfig(max_model_len=128, max_prompt_tokens=16, sampling=SamplingConfig(max_new_tokens=8))
        served = RolloutPool(cfg, str(ckpt / "policy"), num_workers=1, seed=0, options=PoolOptions(num_cpus=0))
        try:
            out = served.generate(PROMPTS, step=0, greedy=True)
        finally:
            served.shutdown()
        assert close_logprobs(out.logprobs, group.policy_logprobs(out))
    finally:
        group.shutdown()

"""The sending side of weight sync: learner ranks (ZeRO 0 and ZeRO-3 over 2 ranks) to real vLLM
engines through the WeightChannel and vLLM's weight-transfer API; a learner checkpoint served by
vLLM as is; and the sync check (rollout/sync_check.py): a sync that arrived passes, with its gap recorded;
a sync that did not (the engines keep stale weights: a load that never happened, or weights lost after a
sleep), and one cast to the wrong dtype on the way, fail at that sync, naming the policy version, the path
and the gap. Every e2e run of the loop checks each of its syncs too (rollout.sync_check on by default)."""

import dataclasses

import pytest
import ray
import torch

from rollout.channel import WeightChannel
from rollout.config import RolloutConfig, SamplingConfig
from rollout.pool import PoolOptions, RolloutPool
from rollout.sync_check import TOLERANCE, SyncCheck, SyncCheckFailed
from tests.helpers import make_scored_batch, tiny_learner

pytestmark = pytest.mark.e2e
PROMPTS = ["12+34=", "7*8=", "hello"]
CHECK = SyncCheck("full weights, float32", TOLERANCE["float32"])


@pytest.fixture(scope="module")
def pool(ray_cluster, tiny_model):
    cfg = RolloutConfig(max_model_len=128, max_prompt_tokens=16, sampling=SamplingConfig(max_new_tokens=8))
    p = RolloutPool(cfg, tiny_model, num_workers=2, seed=0, options=PoolOptions(num_cpus=0))
    yield p
    p.shutdown()


@pytest.fixture(scope="module")
def learner(ray_cluster, tiny_model):
    """One rank (ZeRO 0), shared by the tests that need a learner but not its starting weights (the first
    one-rank sync moves it on from them itself)."""
    group = tiny_learner(tiny_model)
    yield group
    group.shutdown()


def close_logprobs(a, b, tol=1e-4):
    return all(len(x) == len(y) and torch.allclose(torch.tensor(x), torch.tensor(y), atol=tol) for x, y in zip(a, b))


def train(learner, tiny_model, seed: int) -> None:
    learner.update(*make_scored_batch(tiny_model, seed=seed), step=0)


@pytest.mark.parametrize("world, zero", [(1, 0), (2, 3)])
def test_learner_weights_reach_every_engine(pool, tiny_model, world, zero, request):
    # the module's rank is (1, 0)
    group = request.getfixturevalue("learner") if world == 1 else tiny_learner(tiny_model, world, zero)
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
        if world != 1:
            group.shutdown()


def test_a_learner_checkpoint_is_served_by_vllm_as_is(learner, tiny_model, tmp_path):
    train(learner, tiny_model, 20)
    ckpt = learner.save(tmp_path / "ckpt")
    cfg = RolloutConfig(max_model_len=128, max_prompt_tokens=16, sampling=SamplingConfig(max_new_tokens=8))
    served = RolloutPool(cfg, str(ckpt / "policy"), num_workers=1, seed=0, options=PoolOptions(num_cpus=0))
    try:
        out = served.generate(PROMPTS, step=0, greedy=True)
    finally:
        served.shutdown()
    assert close_logprobs(out.logprobs, learner.policy_logprobs(out))


def test_a_sync_that_arrived_passes_and_one_that_did_not_fails_naming_version_path_and_gap(pool, learner, tiny_model):
    channel = WeightChannel(pool, learner, bucket_mb=1, timeout_s=60, check=CHECK)
    assert len(channel.probe) > 8
    train(learner, tiny_model, 30)
    channel.send(version=1)
    assert 0 <= channel.probe_gap < CHECK.tolerance / 10  # float32 on both sides: far inside the tolerance
    train(learner, tiny_model, 35)
    channel.send(version=2, wait=False)  # a background sync: checked once the engines have it
    assert channel.unchecked is not None
    train(learner, tiny_model, 36)  # the learner moves on meanwhile: the check is against the version sent
    channel.wait_sent()
    assert channel.unchecked is None and channel.probe_gap < CHECK.tolerance / 10

    train(learner, tiny_model, 31)  # and on; the engines keep version 2's weights (as after a lost load)
    with pytest.raises(SyncCheckFailed, match=r"policy version 3 \(full weights, float32\): engine \d .* nats"):
        channel.verify(version=3)
    channel.send(version=3)  # a real sync repairs it
    assert channel.probe_gap < CHECK.tolerance / 10


def test_weights_cast_to_another_dtype_on_the_way_fail_the_check(pool, learner, tiny_model):
    channel = WeightChannel(pool, learner, bucket_mb=1, timeout_s=60, check=CHECK)
    train(learner, tiny_model, 32)
    channel.buckets = [[dataclasses.replace(m, dtype="bfloat16") for m in bucket] for bucket in channel.buckets]
    with pytest.raises(SyncCheckFailed, match=r"policy version 5 .* nats away from the learner") as failed:
        channel.send(version=5)
    gap = float(str(failed.value).split("scores the probe ")[1].split(" nats")[0])
    assert gap > CHECK.tolerance

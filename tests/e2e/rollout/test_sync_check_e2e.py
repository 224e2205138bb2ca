"""The sync check (rollout/sync_check.py) on real engines and a real learner: a sync that arrived passes, with
its gap recorded; a sync that did not (the engines keep stale weights: a load that never happened, or weights
lost after a sleep), and one cast to the wrong dtype on the way, fail at that sync, naming the policy version,
the path and the gap. Every e2e run of the loop checks each of its syncs too (rollout.sync_check on by default)."""

import dataclasses

import pytest

from learner.config import AlgorithmConfig, Estimator, LearnerConfig
from learner.group import LearnerGroup, RankPlacement
from rollout.channel import WeightChannel
from rollout.config import RolloutConfig, SamplingConfig
from rollout.pool import PoolOptions, RolloutPool
from rollout.sync_check import TOLERANCE, SyncCheck, SyncCheckFailed
from runtime.logprobs import SamplerSettings
from tests.helpers import make_scored_batch

pytestmark = pytest.mark.e2e
CHECK = SyncCheck("full weights, float32", TOLERANCE["float32"])


@pytest.fixture(scope="module")
def roles(ray_cluster, tiny_model):
    cfg = RolloutConfig(max_model_len=128, max_prompt_tokens=16, sampling=SamplingConfig(max_new_tokens=8))
    pool = RolloutPool(cfg, tiny_model, num_workers=1, seed=0, options=PoolOptions(num_cpus=0))
    algo = AlgorithmConfig(estimator=Estimator.grpo, mini_batch_size=8, micro_batch_size=4)
    learner = LearnerGroup(
        LearnerConfig(model_path=tiny_model, lr=5e-3),
        algo,
        SamplerSettings(n_samples_per_prompt=4),
        1,
        seed=0,
        placement=RankPlacement(num_cpus=0, threads=1),
    )
    yield pool, learner
    learner.shutdown()
    pool.shutdown()


def train(learner, tiny_model, step: int) -> None:
    learner.update(*make_scored_batch(tiny_model, seed=30 + step), step=step)


def test_a_sync_that_arrived_passes_and_one_that_did_not_fails_naming_version_path_and_gap(roles, tiny_model):
    pool, learner = roles
    channel = WeightChannel(pool, learner, bucket_mb=1, timeout_s=60, check=CHECK)
    assert len(channel.probe) > 8
    train(learner, tiny_model, 0)
    channel.send(version=1)
    assert 0 <= channel.probe_gap < CHECK.tolerance / 10  # float32 on both sides: far inside the tolerance
    train(learner, tiny_model, 5)
    channel.send(version=2, wait=False)  # a background sync: checked once the engines have it
    assert channel.unchecked is not None
    train(learner, tiny_model, 6)  # the learner moves on meanwhile: the check is against the version sent
    channel.wait_sent()
    assert channel.unchecked is None and channel.probe_gap < CHECK.tolerance / 10

    train(learner, tiny_model, 1)  # and on; the engines keep version 2's weights (as after a lost load)
    with pytest.raises(SyncCheckFailed, match=r"policy version 3 \(full weights, float32\): engine 0 .* nats"):
        channel.verify(version=3)
    channel.send(version=3)  # a real sync repairs it
    assert channel.probe_gap < CHECK.tolerance / 10


def test_weights_cast_to_another_dtype_on_the_way_fail_the_check(roles, tiny_model):
    pool, learner = roles
    channel = WeightChannel(pool, learner, bucket_mb=1, timeout_s=60, check=CHECK)
    train(learner, tiny_model, 2)
    channel.buckets = [[dataclasses.replace(m, dtype="bfloat16") for m in bucket] for bucket in channel.buckets]
    with pytest.raises(SyncCheckFailed, match=r"policy version 5 .* nats away from the learner") as failed:
        channel.send(version=5)
    gap = float(str(failed.value).split("scores the probe ")[1].split(" nats")[0])
    assert gap > CHECK.tolerance

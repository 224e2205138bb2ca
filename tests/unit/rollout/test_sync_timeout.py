"""A weight-sync broadcast whose receiver never takes part times out within the group's timeout and
says which group, rank and bucket, instead of waiting forever (gloo, two real processes)."""

import multiprocessing as mp

import pytest
import torch

from rollout.weight_sync import SyncFailed, SyncGroup, TensorMeta, free_port, send_weights


def join_and_stay_silent(port: int, joined, release) -> None:
    group = SyncGroup("127.0.0.1", port, 1, 2, "gloo", timeout_s=30)
    joined.set()
    release.wait(60)  # joined the group, but never receives: a stopped engine
    del group


def test_a_broadcast_no_receiver_takes_part_in_times_out_naming_the_group_rank_and_bucket():
    port, ctx = free_port(), mp.get_context("spawn")
    joined, release = ctx.Event(), ctx.Event()
    receiver = ctx.Process(target=join_and_stay_silent, args=(port, joined, release), daemon=True)
    receiver.start()
    try:
        group = SyncGroup("127.0.0.1", port, 0, 2, "gloo", timeout_s=2)
        assert joined.wait(60)
        weights = {"w": torch.ones(4), "b": torch.zeros(2)}
        buckets = [[TensorMeta("w", (4,), "float32")], [TensorMeta("b", (2,), "float32")]]
        with pytest.raises(SyncFailed) as e:
            send_weights(group, buckets, weights.__getitem__)
        message = str(e.value)
        assert f"127.0.0.1:{port}" in message and "rank 0 of 2" in message and "gloo" in message
        assert "sending bucket 1 of 2" in message and "within 2 s" in message
    finally:
        release.set()
        receiver.join(30)

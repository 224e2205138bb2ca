"""A weight-sync broadcast whose receiver never takes part times out within the group's timeout and
says which group, rank and bucket, instead of waiting forever (gloo, two real processes); so does
relay's gloo engine, driven as vLLM's worker drives it, when its sender stalls or is killed; and
that engine loads what a real sender sends.

A group's timeout covers its joining too, so no short timeout may also cover the other process's start-up
(imports, under load many seconds): the process with the short timeout starts its part only once the other
has signalled that it is ready, and a rank joins only once the first rank's store listens (until_listening),
so it connects at its first try. Each timed wait then covers a few messages between two ready processes,
whatever the machine's speed or load."""

import multiprocessing as mp
import os
import signal
import socket
import time

import pytest
import torch

from rollout.weight_sync import SyncFailed, SyncGroup, TensorMeta, send_weights
from runtime.ports import free_port


def until_listening(port: int) -> None:
    """Return once rank 0's store listens at `port`. A rank that connects before then is retried by
    TCPStore with a growing backoff (0.5 s, x1.5 a try, up to a minute), which outlasts a 2 s timeout on
    the other side once rank 0 comes up late; a rank that connects after it joins at once."""
    for _ in range(6000):  # a guard against a rank 0 that never comes up (~60 s), not the test's deadline
        try:
            socket.create_connection(("127.0.0.1", port), timeout=10).close()
            return
        except OSError:
            time.sleep(0.01)
    raise AssertionError(f"nothing listens at 127.0.0.1:{port}")


def join_and_stay_silent(port: int, starting, joined, release) -> None:
    starting.set()  # imports done: the other side's 2 s start now
    until_listening(port)
    group = SyncGroup("127.0.0.1", port, 1, 2, "gloo", timeout_s=30)
    joined.set()
    release.wait(60)  # joined the group, but never receives: a stopped engine
    del group


def test_a_broadcast_no_receiver_takes_part_in_times_out_naming_the_group_rank_and_bucket():
    port, ctx = free_port(), mp.get_context("spawn")
    starting, joined, release = ctx.Event(), ctx.Event(), ctx.Event()
    receiver = ctx.Process(target=join_and_stay_silent, args=(port, starting, joined, release), daemon=True)
    receiver.start()
    try:
        assert starting.wait(60)  # the 2 s timeout covers joining too: not the receiver's start-up
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


class TinyModel(torch.nn.Module):
    """Stands in for vLLM's model inside the engine: parameters and a load_weights that copies."""

    def __init__(self):
        super().__init__()
        self.w, self.b = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(2))

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, t in weights:
            params[name].data.copy_(t)


def gloo_engine(port: int, timeout_s: float, go):
    """relay's engine as vLLM's worker builds and drives it (parse + init), joined as rank 1 of 2 once the
    sender, told to start by `go` when the engine is built (vLLM imported), listens."""
    from types import SimpleNamespace

    from rollout.transfer import GlooWeightTransferEngine
    from rollout.weight_sync import GLOO_BACKEND, GroupAddress, init_info

    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(rank=0), model_config=None)
    engine = GlooWeightTransferEngine(None, vllm_config, torch.device("cpu"), TinyModel())
    info = init_info(GLOO_BACKEND, GroupAddress("127.0.0.1", port, 1, 2, timeout_s))
    go.set()
    until_listening(port)
    engine.init_transfer_engine(engine.parse_init_info(info))
    return engine


def join_and_send_or_fail(port: int, how: str, go, joined) -> None:
    """The sender's end: sends two syncs; or joins and then stays silent / waits to be killed. It starts the
    group when the engine's side says `go`: its timeout must not cover that side's imports."""
    assert go.wait(600)
    group = SyncGroup("127.0.0.1", port, 0, 2, "gloo", timeout_s=30)
    joined.set()
    if how == "send":
        buckets = [[TensorMeta("w", (4,), "float32")], [TensorMeta("b", (2,), "float32")]]
        for scale in (1.0, 2.0):
            send_weights(group, buckets, {"w": torch.arange(4.0) * scale, "b": torch.ones(2) * scale}.__getitem__)
    time.sleep(60)


def test_the_gloo_engine_loads_what_the_sender_sends_through_vllms_update_calls():
    from rollout.weight_sync import GLOO_BACKEND, update_info

    port, ctx = free_port(), mp.get_context("spawn")
    go, joined = ctx.Event(), ctx.Event()  # held here: the child opens them by name
    sender = ctx.Process(target=join_and_send_or_fail, args=(port, "send", go, joined), daemon=True)
    sender.start()
    try:
        engine = gloo_engine(port, 30, go)
        buckets = [[TensorMeta("w", (4,), "float32")], [TensorMeta("b", (2,), "float32")]]
        for scale in (1.0, 2.0):  # the second through the copies found on the first
            engine.start_weight_update()
            engine.update_weights(update_info(GLOO_BACKEND, buckets))
            engine.finish_weight_update()
            assert torch.equal(engine.model.w.data, torch.arange(4.0) * scale)
            assert torch.equal(engine.model.b.data, torch.ones(2) * scale)
        assert engine.loaded == 2 and engine.copies is not None and set(engine.routes) == {"w", "b"}
    finally:
        sender.kill()
        sender.join(30)


@pytest.mark.parametrize("how", ["silent", "killed"])
def test_an_engine_whose_sender_stalls_or_dies_raises_sync_failed_naming_group_rank_and_bucket(how):
    from rollout.weight_sync import GLOO_BACKEND, update_info

    port, ctx = free_port(), mp.get_context("spawn")
    go, joined = ctx.Event(), ctx.Event()
    sender = ctx.Process(target=join_and_send_or_fail, args=(port, how, go, joined), daemon=True)
    sender.start()
    try:
        engine = gloo_engine(port, 2, go)  # its 2 s cover joining too: it joins once the sender listens
        assert joined.wait(60)
        if how == "killed":
            os.kill(sender.pid, signal.SIGKILL)
            sender.join(30)
        buckets = [[TensorMeta("w", (4,), "float32")], [TensorMeta("b", (2,), "float32")]]
        engine.start_weight_update()
        with pytest.raises(SyncFailed) as e:
            engine.update_weights(update_info(GLOO_BACKEND, buckets))
        message = str(e.value)
        assert f"127.0.0.1:{port}" in message and "rank 1 of 2" in message and "gloo" in message
        assert "receiving bucket 1 of 2" in message
        assert ("within 2 s" if how == "silent" else "lost a rank") in message
    finally:
        sender.kill()
        sender.join(30)

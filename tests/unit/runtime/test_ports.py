"""runtime.ports.free_port: a rendezvous port below the kernel's ephemeral range, where no bind(0) or outgoing
connection of another process is handed it between the choice and the store's bind (EADDRINUSE in CI); and
listening_store, a store bound before anyone is told its port."""

import datetime
import random
import socket

import pytest
import torch.distributed as dist

from runtime import ports
from runtime.ports import _ephemeral_low, free_port, listening_store


def test_the_port_is_free_below_the_ephemeral_range_and_above_rays_worker_ports():
    low = _ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert all(20000 <= p < low for p in ports) and len(ports) > 1  # drawn at random, not one port every time
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free: binds


def test_a_port_in_use_is_never_chosen():
    with socket.socket() as held:
        held.bind(("127.0.0.1", free_port()))
        held.listen()
        taken = held.getsockname()[1]
        assert all(free_port() != taken for _ in range(200))


def test_the_draw_ignores_the_run_seed():
    """The learner seeds the global `random` with the run's seed: ports drawn from it repeated run to run."""
    random.seed(0)
    first = [free_port() for _ in range(4)]
    random.seed(0)
    assert [free_port() for _ in range(4)] != first


def test_a_store_listens_before_its_port_is_told_and_a_port_taken_meanwhile_is_drawn_again(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        drawn = iter([taken, taken, ports.free_port()])  # another process binds the first two in the gap
        monkeypatch.setattr(ports, "free_port", lambda host: next(drawn))
        store = listening_store("127.0.0.1", timeout_s=5)
        assert store.port != taken
        client = dist.TCPStore("127.0.0.1", store.port, None, False, datetime.timedelta(seconds=5))
        client.set("k", "v")
        assert store.get("k") == b"v"


def test_a_store_that_fails_otherwise_raises_at_once(monkeypatch):
    drawn = []
    monkeypatch.setattr(ports, "free_port", lambda host: drawn.append(1) or 1)  # port 1: not ours to bind
    with pytest.raises(dist.DistNetworkError):
        listening_store("203.0.113.1", timeout_s=5)  # an address this machine does not have
    assert len(drawn) == 1

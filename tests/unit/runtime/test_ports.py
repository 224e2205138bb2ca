"""runtime.ports.free_port: a rendezvous port below the kernel's ephemeral range, where no bind(0) or outgoing
connection of another process is handed it between the choice and the store's bind (EADDRINUSE in CI)."""

import socket

from runtime.ports import _ephemeral_low, free_port


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

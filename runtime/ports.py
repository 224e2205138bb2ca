"""A port for a rendezvous (the weight-sync group's store), free when chosen and bound a moment later."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def free_port(host: str = "127.0.0.1", tries: int = 64) -> int:
    """A port free on `host` now, for a rendezvous bound a moment later. Drawn below the kernel's ephemeral
    range (and above Ray's worker ports, 10002-19999): a port bind(0) hands out is one the kernel gives the
    next outgoing connection or bind(0) of any process too, which took a store's port in CI (EADDRINUSE)."""
    low = _ephemeral_low()
    for port in random.sample(range(20000, low), min(tries, max(low - 20000, 0))):
        with socket.socket() as s:
            try:
                s.bind((host, port))
                return port
            except OSError:
                continue
    with socket.socket() as s:  # no port free below the range: the kernel's choice
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; elsewhere the same range is a safe guess

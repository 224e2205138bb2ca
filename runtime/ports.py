"""Ports for a rendezvous: free_port, free when chosen and bound a moment later by another process (DeepSpeed's
rendezvous, vLLM's NCCL group); listening_store, a store already listening, for a group whose master we build."""

from __future__ import annotations

import datetime
import random
import socket
from pathlib import Path

import torch.distributed as dist

# Not the global `random`: the learner seeds that with the run's seed, so every run of one seed drew the same ports.
_draw = random.SystemRandom()


def free_port(host: str = "127.0.0.1", tries: int = 64) -> int:
    """A port free on `host` now, for a rendezvous bound a moment later. Drawn below the kernel's ephemeral
    range (and above Ray's worker ports, 10002-19999): a port bind(0) hands out is one the kernel gives the
    next outgoing connection or bind(0) of any process too, which took a store's port in CI (EADDRINUSE)."""
    low = _ephemeral_low()
    for port in _draw.sample(range(20000, low), min(tries, max(low - 20000, 0))):
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


def listening_store(host: str, timeout_s: float, tries: int = 8) -> dist.TCPStore:
    """A TCPStore master already listening on a free port of `host` (its .port), for clients told that port next.
    A port another process took between the choice and the bind (EADDRINUSE) is drawn again."""
    for attempt in range(tries):
        try:
            timeout = datetime.timedelta(seconds=timeout_s)
            return dist.TCPStore(host, free_port(host), None, True, timeout, wait_for_workers=False)
        except dist.DistNetworkError as e:
            if "EADDRINUSE" not in str(e) or attempt == tries - 1:
                raise

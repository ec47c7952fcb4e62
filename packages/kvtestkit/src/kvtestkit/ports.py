"""Free loopback ports for the servers, coordinators and engines a test or bench starts (stdlib only).

Ports are picked below the kernel's ephemeral range: a port the OS hands out for `bind(0)` is also
what it hands to every outgoing connection on a busy host (engines, HTTP clients, ZMQ peers), so
such a port can be taken by a connection before our server binds it. Under pytest-xdist each
worker picks from its own slice, so two workers never pick the same port."""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

SLICES = 8  # xdist workers get disjoint port slices (more workers share slices, as before)
_given: set[int] = set()  # ports this process handed out: never twice


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _candidates() -> range:
    """The ports this process may pick: below the ephemeral range, its xdist worker's slice of them."""
    top = _ephemeral_start()
    bottom = max(10000, top - 16384)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if top - bottom < 2 * SLICES or not worker.startswith("gw") or not worker[2:].isdigit():
        return range(bottom, top)
    width = (top - bottom) // SLICES
    start = bottom + (int(worker[2:]) % SLICES) * width
    return range(start, start + width)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, outside the range the OS gives outgoing connections (a
    parallel process could still take it: `with_fresh_ports` retries a start that lost the race)."""
    pool = _candidates()
    if len(pool) > 0:
        for _ in range(64):
            port = random.randrange(pool.start, pool.stop)
            if port not in _given and _bindable(port):
                _given.add(port)
                return port
    with socket.socket() as s:  # no room below the ephemeral range: the OS's pick
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


T = TypeVar("T")
PORT_CLASH = ("Address already in use", "cannot bind", "cannot listen")


def with_fresh_ports(start: Callable[[], T], attempts: int = 3) -> T:
    """`start()` (which picks its ports with free_port), again with new ports while it fails because
    a parallel process took a port between the pick and the bind."""
    for attempt in range(attempts):
        try:
            return start()
        except RuntimeError as exc:
            if attempt == attempts - 1 or not any(s in str(exc) for s in PORT_CLASH):
                raise
    raise AssertionError("unreachable")

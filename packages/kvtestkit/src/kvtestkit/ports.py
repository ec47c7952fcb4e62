"""Free loopback ports for the servers, coordinators and engines a test or bench starts (stdlib only)."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import TypeVar


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it; a parallel process could still take it)."""
    with socket.socket() as s:
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

"""Connections that send no request are closed, and the admin API holds a bounded number of them.

uvicorn arms its keep-alive timer only after a response, so a client that connects and sends
nothing (or half a request line) holds a descriptor forever; many such clients exhaust the
server's descriptors and new clients time out. Here each connection must deliver a complete
request head within `idle_timeout` of connecting or of its last response, and beyond
`max_connections` the longest-idle connection is closed for the new one (a busy one never is).
A client that keeps its connection alive between requests just reconnects (httpx does).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol


class IdleGuardH11(H11Protocol):
    """uvicorn's h11 protocol with a request-head deadline and a connection cap (class attributes)."""

    idle_timeout: float = 10.0
    max_connections: int = 1024

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._idle_timer: asyncio.TimerHandle | None = None
        self._idle_since = 0.0
        self._waiting_after: Any = None  # the request cycle current when the deadline was armed

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()
        if len(self.connections) > self.max_connections:  # cheap test first; closing ones leave a bit later
            self._drop_longest_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()

    def _idle(self) -> bool:
        """No request has begun since the deadline was armed (none running, none being read)."""
        return self.cycle is self._waiting_after

    def _arm(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        self._idle_since = self.loop.time()
        self._waiting_after = self.cycle
        self._idle_timer = self.loop.call_later(self.idle_timeout, self._expire)

    def _expire(self) -> None:
        self._idle_timer = None
        if self._idle() and not self.transport.is_closing():
            self.transport.close()

    def _drop_longest_idle(self) -> None:
        live = [c for c in self.connections if isinstance(c, IdleGuardH11) and not c.transport.is_closing()]
        if len(live) <= self.max_connections:
            return
        idle = [c for c in live if c._idle() and c is not self]
        victim = min(idle, key=lambda c: c._idle_since, default=self)  # all busy: the newcomer goes
        victim.transport.close()


def guarded_protocol(idle_timeout: float, max_connections: int) -> type[IdleGuardH11]:
    """The protocol class for one server's limits (uvicorn takes a class, not an instance)."""
    return type("IdleGuardH11", (IdleGuardH11,), {"idle_timeout": idle_timeout, "max_connections": max_connections})

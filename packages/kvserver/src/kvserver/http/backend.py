"""AdminBackend: everything the HTTP layer (admin API, metrics, fleet agent) needs of a running server.

Why a Protocol: the HTTP modules used to reach into KVServer's internals (its L1, cache service, arena,
KV events), so any change there rippled into http/* and the two imported each other. Now they see
only this, KVServer satisfies it structurally, and nothing under http/ imports server.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from kvprotocol._requests import Request

    from ..config import ServerConfig
    from ..kvevents import EventsSnapshot

Observer = Callable[[str, float, "str | None"], None]  # (op, seconds, error code or None) per request


class AdminBackend(Protocol):
    config: ServerConfig
    ready: bool  # the control plane serves (/readyz)
    observers: list[Observer]  # called once per request, ZMQ and HTTP alike (latency histogram)

    @property
    def api_token(self) -> str:
        """The server's own token: key endpoints always need it, status and metrics beyond loopback."""
        ...

    def describe(self) -> dict[str, Any]:
        """Everything an operator may see (/v1/status, every Prometheus series)."""
        ...

    async def execute(self, req: Request) -> dict[str, Any]:
        """Run one request through the control plane's handlers and accounting (raises its errors)."""
        ...

    def count_refused(self, op: str, exc: Exception) -> None:
        """Count a body refused before it became a request as an error of its op."""
        ...

    def fleet_stats(self) -> dict[str, Any]:
        """What a fleet coordinator tracks of this server, sent with every heartbeat."""
        ...

    def kv_events_snapshot(self) -> EventsSnapshot | None:
        """The blocks KV events have announced and not removed; None when KV events are off."""
        ...

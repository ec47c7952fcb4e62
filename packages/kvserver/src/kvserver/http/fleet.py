"""Membership in a fleet coordinator: register, heartbeat, re-register on 404, deregister on exit.

The coordinator holds soft state only, so this loop is what heals it: after a coordinator restart
the first heartbeat gets 404 and the server registers again. A coordinator that is down never
affects serving; failures are logged once per outage, not once per heartbeat.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import httpx

import kvprotocol
from kvprotocol._credentials import default_token

from .backend import AdminBackend

log = logging.getLogger("kvserver.fleet")
REQUEST_TIMEOUT = 3.0
REGISTER_RETRY = 0.25  # first retry of a failed registration, doubling up to the heartbeat interval


def advertised(scheme: str, host: str, port: int) -> str:
    """The URL peers can reach a bind address by (a wildcard bind advertises this host's name)."""
    name = socket.getfqdn() if host in ("0.0.0.0", "::", "") else host
    return f"{scheme}://[{name}]:{port}" if ":" in name else f"{scheme}://{name}:{port}"


def advertised_endpoint(endpoint: str) -> str:
    """A ZMQ bind endpoint as peers connect to it (ipc:// as is; a wildcard host becomes this host's name)."""
    scheme, _, rest = endpoint.partition("://")
    if scheme != "tcp":
        return endpoint
    host, _, port = rest.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return advertised("tcp", host if host != "*" else "", int(port))


def kv_events_ad(cfg: Any) -> dict[str, Any] | None:
    """Where this server's KV events are, for the coordinator's prefix index (None when they are off)."""
    if not cfg.kv_events_endpoint:
        return None
    return {
        "endpoint": advertised_endpoint(cfg.kv_events_endpoint),
        "replay_endpoint": (
            advertised_endpoint(cfg.kv_events_replay_endpoint) if cfg.kv_events_replay_endpoint else None
        ),
        "topic": cfg.kv_events_topic.format(host=socket.gethostname(), model="{model}"),
    }


def _why(exc: Exception) -> str:
    if isinstance(exc, httpx.HTTPStatusError):
        code = exc.response.status_code
        hint = ": the fleet's --api-token differs" if code in (401, 403) else ""
        return f"refused us (HTTP {code}{hint})"
    return f"unavailable ({type(exc).__name__}: {str(exc)[:200]})"


class FleetAgent:
    def __init__(self, server: AdminBackend, coordinator: str, http_port: int | None) -> None:
        self.server = server
        self.base = coordinator.rstrip("/")
        cfg = server.config
        self.zmq_url = advertised("tcp", cfg.host, cfg.port)
        self.http_url = advertised("http", cfg.http_host, http_port) if http_port else None
        self.instance_id: str | None = None
        self.registrations = 0
        self._outage = False
        if cfg.log_level != "debug":  # one INFO line per heartbeat would drown the log
            logging.getLogger("httpx").setLevel(logging.WARNING)
        # proxies from the environment are ignored: the coordinator sits on the cluster network
        self._client = httpx.AsyncClient(timeout=REQUEST_TIMEOUT, trust_env=False)

    def headers(self) -> dict[str, str]:
        """The configured token (the fleet token), else the coordinator's own generated token from its
        default file (a same-user coordinator on loopback), read afresh so a later start is found."""
        token = self.server.config.api_token or default_token(self.base)
        return {"Authorization": f"Bearer {token}"} if token else {}

    def registration(self) -> dict[str, Any]:
        cfg = self.server.config
        capacity = self.server.describe()["l1"]["capacity_bytes"]  # once per registration: describe is cheap enough
        out = {
            "zmq_url": self.zmq_url,
            "http_url": self.http_url,
            "l1_capacity_bytes": capacity,
            "version": kvprotocol.__version__,
            "chunk_size": cfg.chunk_size,
            "heartbeat_interval": cfg.heartbeat_interval,
            **self.server.fleet_stats(),
        }
        events = kv_events_ad(cfg)
        if events is not None and self.http_url is not None:  # the coordinator resyncs over HTTP
            out["kv_events"] = events
        return out

    async def _register(self) -> None:
        reply = await self._client.post(f"{self.base}/v1/instances", json=self.registration(), headers=self.headers())
        reply.raise_for_status()
        self.instance_id = str(reply.json()["instance_id"])
        self.registrations += 1
        log.info("registered with coordinator %s as %s", self.base, self.instance_id)

    async def beat(self) -> None:
        """One heartbeat (registering first when needed); raises on transport or HTTP errors."""
        if self.instance_id is None:
            await self._register()
            return
        reply = await self._client.put(
            f"{self.base}/v1/instances/{self.instance_id}/heartbeat",
            json=self.server.fleet_stats(),
            headers=self.headers(),
        )
        if reply.status_code == 404:
            log.info("coordinator forgot instance %s (restarted or timed out); registering again", self.instance_id)
            self.instance_id = None
            await self._register()
            return
        reply.raise_for_status()

    async def run(self) -> None:
        """Heartbeat every interval; while unregistered, retry sooner (backing off up to the interval),
        so a server with rare heartbeats joins the fleet as soon as the coordinator answers."""
        interval = self.server.config.heartbeat_interval
        retry = REGISTER_RETRY
        while True:
            try:
                await self.beat()
                if self._outage:
                    log.info("coordinator %s reachable again", self.base)
                self._outage = False
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                if not self._outage:
                    log.warning(
                        "coordinator %s %s; serving continues, retrying (at most every %.1fs)",
                        self.base,
                        _why(exc),
                        interval,
                    )
                self._outage = True
            if self.instance_id is None:
                await asyncio.sleep(min(retry, interval))
                retry *= 2
            else:
                retry = REGISTER_RETRY
                await asyncio.sleep(interval)

    async def close(self) -> None:
        """Deregister (best effort, short timeout) and close the client."""
        if self.instance_id is not None:
            try:
                await self._client.delete(
                    f"{self.base}/v1/instances/{self.instance_id}", timeout=1.0, headers=self.headers()
                )
            except httpx.HTTPError as exc:
                log.info("could not deregister from coordinator: %s", exc)
        await self._client.aclose()

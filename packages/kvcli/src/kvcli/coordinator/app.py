"""The coordinator app factory: membership, fleet status, fleet lookup and metrics.

Endpoints are `async def` (one event loop, no locks around the registry). The fan-out client is
created in the app's lifespan; it presents credentials only to instances it trusts (see
credentials.py), so one fleet token serves both directions without leaking to a registrant's URL.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import Depends, FastAPI, Request, Response
from prometheus_client.exposition import choose_encoder

import kvprotocol

from .credentials import InstanceCredentials
from .errors import ApiError, install_error_handlers
from .fanout import fleet_query, fleet_status, summarize
from .limits import BodyLimit
from .metrics import CoordinatorMetrics
from .models import LookupBody, Registration, Stats
from .registry import Registry, RegistryFull
from .security import Guard

MAX_BODY_BYTES = 8 << 20  # 1M tokens as a JSON list


@dataclass(frozen=True)
class CoordinatorSettings:
    host: str = "127.0.0.1"
    port: int = 9090
    instance_timeout: float = 15.0
    fanout_timeout: float = 2.0
    api_token: str | None = None
    insecure: bool = False
    trusted_hosts: tuple[str, ...] = ()  # non-loopback instance hosts the fleet token may be sent to


def create_app(settings: CoordinatorSettings, registry: Registry | None = None) -> FastAPI:
    registry = registry or Registry(settings.instance_timeout)
    metrics = CoordinatorMetrics(registry, kvprotocol.__version__)
    guard = Guard(settings.host, settings.api_token)
    creds = InstanceCredentials(settings.api_token, settings.trusted_hosts)
    clients: dict[str, httpx.AsyncClient] = {}

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        clients["fanout"] = httpx.AsyncClient(trust_env=False,
                                              limits=httpx.Limits(max_connections=256))
        try:
            yield
        finally:
            await clients.pop("fanout").aclose()

    app = FastAPI(title="kvcli coordinator", version=kvprotocol.__version__, lifespan=lifespan,
                  description="Soft-state membership of kvservers, fleet status and KV-aware routing hints.")
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_body=MAX_BODY_BYTES)
    read, write = [Depends(guard.read)], [Depends(guard.write)]

    @app.get("/healthz", tags=["probes"])
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/instances", tags=["membership"], dependencies=write, status_code=201)
    async def register(body: Registration) -> dict[str, Any]:
        """Register a server; answers its instance id and how often to heartbeat at the latest."""
        try:
            inst = registry.register(body.fields())
        except RegistryFull as exc:
            raise ApiError(507, "REGISTRY_FULL", str(exc)) from None
        return {"instance_id": inst.id, "instance_timeout": registry.timeout}

    @app.put("/v1/instances/{instance_id}/heartbeat", tags=["membership"], dependencies=write)
    async def heartbeat(instance_id: str, body: Stats | None = None) -> dict[str, Any]:
        """Refresh an instance; 404 for unknown ids, so the server registers again."""
        inst = registry.heartbeat(instance_id, body.model_dump() if body else {})
        if inst is None:
            raise ApiError(404, "UNKNOWN_INSTANCE", f"no instance {instance_id[:64]!r}; register again")
        return {"instance_id": inst.id, "instance_timeout": registry.timeout}

    @app.delete("/v1/instances/{instance_id}", tags=["membership"], dependencies=write)
    async def deregister(instance_id: str) -> dict[str, Any]:
        if not registry.deregister(instance_id):
            raise ApiError(404, "UNKNOWN_INSTANCE", f"no instance {instance_id[:64]!r}")
        return {"deregistered": instance_id}

    @app.get("/v1/instances", tags=["membership"], dependencies=read)
    async def instances() -> dict[str, Any]:
        """Registered instances with last-seen time and liveness ("live", or "late" when heartbeats lag)."""
        return {"instances": [registry.view(i) for i in registry.live()], "instance_timeout": registry.timeout}

    @app.get("/v1/fleet/status", tags=["fleet"], dependencies=read)
    async def status() -> dict[str, Any]:
        """Every live instance's /v1/status, fetched concurrently; unreachable ones say why."""
        results = await fleet_status(clients["fanout"], creds, registry.live(), settings.fanout_timeout, metrics.outcome)
        return {
            "summary": summarize(results),
            "instances": [{**registry.view(inst), "reachable": error is None, "error": error, "status": body}
                          for inst, body, error in results],
        }

    @app.post("/v1/fleet/lookup", tags=["fleet"], dependencies=read)
    async def lookup(body: LookupBody) -> dict[str, Any]:
        """Which instance holds the longest reusable prefix of these tokens (a routing hint)."""
        body.check()
        live = registry.live()
        results = await fleet_query(clients["fanout"], creds, live, body.model_dump(exclude_none=True),
                                    settings.fanout_timeout, metrics.outcome)
        answered = [(inst, prefix) for inst, prefix, _ in results if prefix is not None]

        def rank(item: tuple[Any, int]) -> tuple[int, float, str]:
            inst, prefix = item
            load = inst.l1_used_bytes / inst.l1_capacity_bytes if inst.l1_capacity_bytes else 1.0
            return (-prefix, load, inst.id)  # longest prefix, then the least full, then stable

        best = min(answered, key=rank) if answered else None
        best_prefix = best[1] if best else 0
        metrics.lookups.inc()
        metrics.lookup_tokens.inc(len(body.tokens))
        metrics.lookup_hit_tokens.inc(best_prefix)
        return {
            "num_tokens": len(body.tokens),
            "prefix_tokens": best_prefix,
            "best": ({"instance_id": best[0].id, "zmq_url": best[0].zmq_url, "http_url": best[0].http_url,
                      "prefix_tokens": best_prefix} if best and best_prefix > 0 else None),
            "instances": [{"instance_id": inst.id, "zmq_url": inst.zmq_url, "prefix_tokens": prefix,
                           "reachable": error is None, "error": error} for inst, prefix, error in results],
        }

    @app.get("/metrics", tags=["metrics"], dependencies=read, response_class=Response)
    async def prometheus(request: Request) -> Response:
        encoder, content_type = choose_encoder(request.headers.get("accept"))
        return Response(encoder(metrics.registry), headers={"Content-Type": content_type})

    app.state.registry = registry
    return app

"""The coordinator app factory: membership, fleet status, fleet lookup and metrics.

Endpoints are `async def` (one event loop, no locks around the registry). The fan-out client is
created in the app's lifespan; it presents the explicitly configured instance token only to
instances it trusts (see credentials.py), never a credential derived from a registrant's URL.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
from fastapi import Depends, FastAPI, Request, Response
from prometheus_client.exposition import choose_encoder

import kvprotocol

from .credentials import InstanceCredentials
from .errors import ApiError, install_error_handlers
from .fanout import fleet_status, summarize
from .index import PrefixIndex
from .limits import BodyLimit
from .lookup_api import LookupFastPath, decode_lookup
from .metrics import CoordinatorMetrics
from .models import LookupBody, Registration, Stats
from .registry import Registry, RegistryFull, prune_forever
from .routing import fleet_lookup
from .subscriber import EventFeeds
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
    trusted_hosts: tuple[str, ...] = ()  # non-loopback instance hosts the instance token may be sent to
    instance_token: str | None = None  # presented to instances (explicitly configured only)


def create_app(settings: CoordinatorSettings, registry: Registry | None = None) -> FastAPI:
    registry = registry or Registry(settings.instance_timeout)
    metrics = CoordinatorMetrics(registry, kvprotocol.__version__)
    guard = Guard(settings.host, settings.api_token)
    creds = InstanceCredentials(settings.instance_token, settings.trusted_hosts)
    clients: dict[str, httpx.AsyncClient] = {}
    feeds: dict[str, EventFeeds] = {}  # the KV-events feeds of the prefix index, while running

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        clients["fanout"] = httpx.AsyncClient(trust_env=False, limits=httpx.Limits(max_connections=256))
        feeds["index"] = EventFeeds(PrefixIndex(), creds, lambda: clients["fanout"], settings.fanout_timeout)
        registry.on_drop.append(lambda inst, _why: feeds["index"].drop(inst) if "index" in feeds else None)
        pruner = asyncio.create_task(prune_forever(registry, min(1.0, registry.timeout / 4)))
        try:
            yield
        finally:
            pruner.cancel()
            await feeds.pop("index").close()
            await clients.pop("fanout").aclose()

    app = FastAPI(
        title="kvcoordinator",
        version=kvprotocol.__version__,
        lifespan=lifespan,
        description="Soft-state membership of kvservers, fleet status and KV-aware routing hints.",
    )
    install_error_handlers(app)
    read, write = [Depends(guard.read)], [Depends(guard.write)]

    @app.get("/healthz", tags=["probes"])
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/instances", tags=["membership"], dependencies=write, status_code=201)
    async def register(body: Registration) -> dict[str, Any]:
        """Register a server; answers its instance id and how often to heartbeat at the latest."""
        try:
            fields = body.fields()
            fields.pop("kv_events_seq", None)
            inst = registry.register(fields)
        except RegistryFull as exc:
            raise ApiError(507, "REGISTRY_FULL", str(exc)) from None
        if "index" in feeds:
            feeds["index"].add(inst)
        return {"instance_id": inst.id, "instance_timeout": registry.timeout}

    @app.put("/v1/instances/{instance_id}/heartbeat", tags=["membership"], dependencies=write)
    async def heartbeat(instance_id: str, body: Stats | None = None) -> dict[str, Any]:
        """Refresh an instance; 404 for unknown ids, so the server registers again."""
        inst = registry.heartbeat(instance_id, body.model_dump() if body else {})
        if inst is None:
            raise ApiError(404, "UNKNOWN_INSTANCE", f"no instance {instance_id[:64]!r}; register again")
        if body is not None and "index" in feeds:
            feeds["index"].heartbeat(inst, body.kv_events_seq)
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
        results = await fleet_status(
            clients["fanout"], creds, registry.live(), settings.fanout_timeout, metrics.outcome
        )
        return {
            "summary": summarize(results),
            "instances": [
                {**registry.view(inst), "reachable": error is None, "error": error, "status": body}
                for inst, body, error in results
            ],
        }

    async def answer_lookup(raw: bytes) -> bytes:
        """A fleet lookup from its raw body to its JSON answer (msgspec both ways)."""
        body = decode_lookup(raw)
        answer = await fleet_lookup(
            clients["fanout"], creds, feeds.get("index"), registry, body, settings.fanout_timeout, metrics.outcome
        )
        metrics.lookups.inc()
        metrics.lookup_tokens.inc(body.num_tokens)
        metrics.lookup_hit_tokens.inc(answer["prefix_tokens"])
        return msgspec.json.encode(answer)

    @app.post(
        "/v1/fleet/lookup",
        tags=["fleet"],
        dependencies=read,
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": msgspec.json.schema(LookupBody)}},
            }
        },
    )
    async def lookup(request: Request) -> Response:
        """Which instance holds the longest reusable prefix of these tokens (a routing hint).

        Served by the LookupFastPath middleware (lookup_api.py), which skips FastAPI's generic
        paths: a lookup has to be far cheaper than a prefill. This route documents it and serves
        the same handler where the middleware is absent.
        """
        return Response(await answer_lookup(await request.body()), media_type="application/json")

    @app.get("/v1/fleet/index", tags=["fleet"], dependencies=read)
    async def index_status(memory: bool = False) -> dict[str, Any]:
        """The prefix index: chunks, feeds in sync, resyncs, event-to-index lag; bytes with ?memory=true."""
        feed = feeds["index"]
        out = {"chunks": len(feed.index), **feed.describe()}
        if memory:
            out["memory_bytes"] = feed.index.memory_bytes()
        return out

    @app.get("/metrics", tags=["metrics"], dependencies=[Depends(guard.metrics)], response_class=Response)
    async def prometheus(request: Request) -> Response:
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encoder(metrics.registry), headers={"Content-Type": content_type})

    app.add_middleware(LookupFastPath, answer=answer_lookup, token=guard.token)
    app.add_middleware(BodyLimit, max_body=MAX_BODY_BYTES)  # the outer one: lookups are capped too
    app.state.registry = registry
    app.state.feeds = feeds  # {"index": EventFeeds} while running (bench/fleet_lookup.py reads it)
    return app

"""The admin API app factory: health, readiness, status, metrics, query, clear, pin and unpin.

Every endpoint is `async def`, so it runs on the server's event-loop thread like the ZMQ handlers:
the cache service needs no locks and HTTP never races the control plane. Mutations go through
`AdminBackend.handlers`, the same entry points the control plane uses.
"""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import Depends, FastAPI, Request, Response
from prometheus_client.exposition import choose_encoder

import kvprotocol
from kvprotocol._requests import Clear, KeysBody, KeysRequest, Pin, Query, Unpin

from . import kvevents_api
from .backend import AdminBackend
from .errors import install_error_handlers
from .limits import RequestLimits
from .metrics import ServerMetrics
from .models import decode_keys
from .security import BearerGate, Guard
from .views import AggregateRegistry, aggregate_status

KEY_PATHS = frozenset({"/v1/query", "/v1/clear", "/v1/pin", "/v1/unpin"})  # token checked before the body
MAX_BODY_BYTES = 8 << 20  # 1M tokens of up to 7 digits as a JSON list; refused before parsing beyond


async def _keys_op(
    server: AdminBackend, request: Request, cls: type[KeysRequest]
) -> tuple[KeysRequest, dict[str, Any]]:
    """Decode a key endpoint's body and run it through the server's one dispatch (counted like ZMQ)."""
    try:
        req = decode_keys(await request.body(), cls)
    except Exception as exc:  # a refused body is an error reply of that op too
        server.count_refused(str(cls.__struct_config__.tag), exc)
        raise
    return req, await server.execute(req)


def create_app(server: AdminBackend, metrics: ServerMetrics | None = None) -> FastAPI:
    """Build the admin API of one server; `metrics` defaults to a fresh private registry."""
    metrics = metrics or ServerMetrics(server)
    guard = Guard(server.config, server.api_token)
    app = FastAPI(
        title="kvserver admin API",
        version=kvprotocol.__version__,
        description="Health, status, metrics and key management of one kvserver.",
    )
    install_error_handlers(app)
    app.add_middleware(BearerGate, token=server.api_token, paths=KEY_PATHS)
    app.add_middleware(RequestLimits, max_body=MAX_BODY_BYTES, counter=metrics.http_requests)
    write = [Depends(guard.write)]

    @app.get("/healthz", tags=["probes"])
    async def healthz() -> dict[str, str]:
        """The process is up and its event loop answers."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["probes"])
    async def readyz(response: Response) -> dict[str, Any]:
        """The control plane is serving (503 while starting or stopping)."""
        ready = server.ready
        response.status_code = 200 if ready else 503
        return {"ready": ready}

    aggregates = AggregateRegistry(metrics.registry)

    @app.get("/metrics", tags=["metrics"], response_class=Response)
    async def prometheus(request: Request, full: bool = Depends(guard.full_view)) -> Response:
        """Prometheus text exposition of this server's private registry (OpenMetrics if asked for);
        per-tenant series only with the token (Prometheus: `authorization.credentials_file`)."""
        encoder, content_type = choose_encoder(request.headers.get("accept") or "")
        body = encoder(metrics.registry if full else aggregates)
        return Response(body, headers={"Content-Type": content_type})

    @app.get("/v1/status", tags=["status"])
    async def status(full: bool = Depends(guard.full_view)) -> dict[str, Any]:
        """What `kvcli describe` shows: config (no secrets), L1 usage, engines, counters, errors;
        tenants and engine ids, hosts and pids only with the token."""
        described = server.describe()
        return described if full else aggregate_status(described)

    @app.post(
        "/v1/query",
        tags=["keys"],
        dependencies=write,  # reveals cache contents: token always
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": msgspec.json.schema(KeysBody)}},
            }
        },
    )
    async def query(request: Request) -> Response:
        """Per-chunk presence of a token sequence and its reusable prefix; leases nothing.

        Routers call this per request: the body is decoded by msgspec straight from the bytes and
        the answer encoded by msgspec, skipping FastAPI's slower generic paths.
        """
        req, result = await _keys_op(server, request, Query)
        result["num_tokens"] = len(req.tokens) // 4
        return Response(msgspec.json.encode(result), media_type="application/json")

    @app.post("/v1/clear", tags=["keys"], dependencies=write)
    async def clear() -> dict[str, Any]:
        """Remove every ready, unleased object from L1."""
        return await server.execute(Clear())

    @app.post("/v1/pin", tags=["keys"], dependencies=write)
    async def pin(request: Request) -> dict[str, Any]:
        """Pin the ready objects of a token sequence so eviction never takes them."""
        return (await _keys_op(server, request, Pin))[1]

    @app.post("/v1/unpin", tags=["keys"], dependencies=write)
    async def unpin(request: Request) -> dict[str, Any]:
        """Make pinned objects of a token sequence evictable again."""
        return (await _keys_op(server, request, Unpin))[1]

    app.include_router(kvevents_api.router(server, write))  # it reveals what is cached
    app.state.server = server
    app.state.metrics = metrics
    return app

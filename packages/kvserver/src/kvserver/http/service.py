"""Run the admin API with uvicorn inside the server's own asyncio loop.

The listening socket is bound when the service is created, so a busy or forbidden port fails
`kvserver start` with a clear message instead of killing a background task later. Signals stay
with kvserver (uvicorn's own handlers are disabled); `stop()` asks uvicorn to drain and exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

import uvicorn

from kvprotocol import listen_socket

from .app import create_app
from .backend import AdminBackend
from .idle import guarded_protocol
from .metrics import ServerMetrics

log = logging.getLogger("kvserver.http")


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the host process owns SIGINT/SIGTERM


class HttpService:
    def __init__(self, server: AdminBackend) -> None:
        cfg = server.config
        try:
            self.sock = listen_socket(cfg.http_host, cfg.http_port)
            self.sock.setblocking(False)
        except OSError as exc:
            raise OSError(f"cannot listen for HTTP on {cfg.http_host}:{cfg.http_port}: {exc.strerror or exc}") from exc
        self.metrics = ServerMetrics(server)
        self.app = create_app(server, self.metrics)
        self.port = int(self.sock.getsockname()[1])
        config = uvicorn.Config(
            self.app,
            lifespan="off",
            log_config=None,
            log_level=cfg.log_level,
            access_log=cfg.log_level == "debug",
            server_header=False,
            timeout_graceful_shutdown=2,
            http=guarded_protocol(cfg.idle_timeout, cfg.http_max_connections),  # idle.py: no idle fd is kept
        )
        self._uvicorn = _EmbeddedServer(config)

    async def serve(self) -> None:
        await self._uvicorn.serve(sockets=[self.sock])

    async def shutdown(self, task: asyncio.Task[None], timeout: float = 5.0) -> None:
        """Let in-flight requests finish, then stop; cancels if uvicorn does not exit in time."""
        self._uvicorn.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout)
        except (TimeoutError, asyncio.CancelledError):
            task.cancel()
        except Exception:
            log.exception("HTTP server failed")

    def close(self) -> None:
        self.sock.close()

"""The kvserver process: a ZMQ ROUTER control plane on one asyncio loop.

Every request gets exactly one reply, malformed ones included; a handler that fails answers INTERNAL
and the loop keeps serving.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import zmq
import zmq.asyncio

import kvprotocol
from kvprotocol import ErrorCode, ValidationError, validate_request
from kvprotocol._messages import MAX_HEADER_BYTES, error_reply, ok_reply, pack, request_id_of, unpack_header

from .arena import HEADER_BYTES, Arena, ArenaLock, arena_name, check_free_space
from .auth import ServerAuth
from .blend_index import BlendService
from .cache import CacheService
from .config import ServerConfig
from .ec import ECCache, check_ec_space, ec_arena_name
from .eviction import make_policy
from .l1 import L1Cache, State
from .l2 import build_tier_manager

log = logging.getLogger("kvserver")
Result = tuple[dict[str, Any], list[Any]]
Handler = Callable[[dict[str, Any], list[memoryview]], Result | Awaitable[Result]]
DATA_OPS = frozenset({"commit", "ec_commit"})  # the only ops that carry data frames in
OPEN_OPS = frozenset({"ping"})  # answered without a token, like the HTTP health probes


def max_frame_bytes(arena_size: int) -> int:
    """ZMQ_MAXMSGSIZE: the largest object an arena of this size holds, or a header frame."""
    return max(MAX_HEADER_BYTES, min(arena_size, kvprotocol.MAX_OBJECT_BYTES))


class KVServer:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.started = time.time()
        self.http: Any = None
        # One server per arena: lock, then bind, and only then touch /dev/shm. A second server on a
        # busy port or arena fails before it could disturb the first; a failed start removes only
        # what it created (close() below is safe on a half-built server).
        name = arena_name(config.port, config.shm_prefix)
        self._lock: ArenaLock | None = ArenaLock(name)
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        try:
            self.auth = ServerAuth(config)  # every op but ping needs the token, on loopback too (auth.py)
            self._sock.setsockopt(zmq.LINGER, 0)
            # No frame can be larger than the largest object this arena can hold (or a header): ZMQ
            # drops the connection of a peer that sends one, after buffering at most that much.
            self._sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes(max(config.l1_bytes, config.ec_bytes)))
            self.auth.secure(self._sock)
            self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
            try:
                self._sock.bind(config.zmq_url)
            except zmq.ZMQError as exc:
                raise RuntimeError(f"cannot bind {config.zmq_url}: {exc}") from None
            self.auth.publish(config.port)  # only once the port is ours
            check_free_space(name, config.l1_bytes + HEADER_BYTES)
            self.arena = Arena(name, config.l1_bytes)
            self.l1 = L1Cache(self.arena, make_policy(config.eviction_policy))
            # the encoder cache: its own segment and budget, never evicted by KV (ec.py)
            check_ec_space(ec_arena_name(name), config.ec_bytes + HEADER_BYTES)
            self.ec_arena = Arena(ec_arena_name(name), config.ec_bytes)
            self.ec = ECCache(self.ec_arena, config.lease_ttl)
            self.cache = CacheService(self.l1, config.chunk_size, config.lease_ttl)
            self.blend = BlendService(self.cache)  # content-keyed chunks (CacheBlend), opt-in per request
            self.l2 = build_tier_manager(config, self.l1)  # None without --l2; ValueError on bad settings
        except BaseException:
            self.close()
            raise
        self._answering: set[asyncio.Task[None]] = set()  # with L2, requests run as tasks (see _serve_loop)
        self.errors: dict[str, int] = {}
        self.op_counts: dict[str, int] = {}
        self.observers: list[Callable[[str, float, str | None], None]] = []  # (op, seconds, error code)
        self._engine_ids = itertools.count(1)
        self._stop = asyncio.Event()
        self.handlers: dict[str, Handler] = self._builtin_handlers()
        if self.l2 is not None:
            self.cache.l2 = self.l2
            self.cache.on_commit.append(self.l2.committed)
            if self.l2.admission.mode != "all":
                self.cache.on_hit.append(self.l2.hit)
            self.handlers["lookup"] = self._lookup_l2
            self.handlers["query"] = self._query_l2
        self.kv_events: Any = None
        if config.kv_events_endpoint:
            from .kvevents import KVEvents

            try:
                self.kv_events = KVEvents(config, self.l1, self.cache, self.l2)
            except Exception:
                self.close()
                raise
        self.ready = False  # true while the control plane serves (the HTTP /readyz answer)
        if config.http_port:
            from .http.service import HttpService  # FastAPI is only imported when the API is on

            try:
                self.http = HttpService(self)
                self.auth.publish(self.http.port)
            except Exception:
                self.close()
                raise

    # -- ops -------------------------------------------------------------------------------------
    def _builtin_handlers(self) -> dict[str, Handler]:
        c = self.cache
        return {
            "ping": lambda f, fr: ({"version": kvprotocol.__version__, "protocol": kvprotocol.PROTOCOL_VERSION,
                                    "time": time.time()}, []),
            "describe": lambda f, fr: (self.describe(), []),
            "register_engine": lambda f, fr: (c.register_engine(f, f"eng-{os.getpid()}-{next(self._engine_ids)}"), []),
            "lookup": lambda f, fr: (c.lookup(f), []),
            "query": lambda f, fr: (c.query(f), []),
            "store": lambda f, fr: (c.store(f), []),
            "commit": lambda f, fr: (c.commit(f["store_id"], fr, f["checksums"]), []),
            "abort": lambda f, fr: (c.abort(f["store_id"]), []),
            "retrieve": lambda f, fr: c.retrieve(f),
            "release": lambda f, fr: (c.release(f), []),
            "end_session": lambda f, fr: (c.end_session(f["session"]), []),
            "clear": lambda f, fr: (c.clear(), []),
            "pin": lambda f, fr: (c.set_pinned(f, True), []),
            "unpin": lambda f, fr: (c.set_pinned(f, False), []),
            **self.ec.handlers(),
            "blend_store": lambda f, fr: (self.blend.store(f), []),
            "blend_lookup": lambda f, fr: (self.blend.lookup(f), []),
        }

    async def _lookup_l2(self, f: dict[str, Any], _frames: list[memoryview]) -> Result:
        return await self.cache.lookup_l2(f), []

    async def _query_l2(self, f: dict[str, Any], _frames: list[memoryview]) -> Result:
        return await self.cache.query_l2(f), []

    def describe(self) -> dict[str, Any]:
        l1, c = self.l1, self.cache
        return {
            "version": kvprotocol.__version__,
            "protocol": kvprotocol.PROTOCOL_VERSION,
            "uptime_s": round(time.time() - self.started, 3),
            "config": self.config.public(),
            "l1": {
                "capacity_bytes": self.arena.capacity,
                "used_bytes": l1.used_bytes,
                "objects": l1.count(State.READY),
                "writing": l1.count(State.WRITING),
                "leased": l1.leased_objects(),
                "pinned": l1.pinned_objects(),
                "evictions": l1.evictions,
                "quarantined": l1.quarantined_slots,
                "quarantined_bytes": l1.quarantined_bytes,
                "arena": self.arena.name,
            },
            "engines": [vars(e) for e in c.engines.values()],
            "sessions": len(c.table.sessions),
            "stores_in_flight": len(c.table.stores),
            "counters": vars(c.counters),
            "ec": self.ec.describe(),
            "blend": self.blend.describe(),  # CacheBlend hits are not prefix hits: never summed with counters
            "errors": dict(self.errors),
            "ops": dict(self.op_counts),
            **({"l2": self.l2.describe(), "l2_queue": self.l2.describe_queue()} if self.l2 is not None else {}),
            **({"kv_events": self.kv_events.describe()} if self.kv_events is not None else {}),
        }

    # -- dispatch --------------------------------------------------------------------------------
    async def handle(self, header_frame: bytes, frames: list[memoryview]) -> tuple[dict[str, Any], list[Any]]:
        """Turn one request into exactly one reply (header map, data frames); never raises."""
        started = time.perf_counter()
        rid, op, code = 0, "invalid", None
        try:
            msg = unpack_header(header_frame)
            rid = request_id_of(msg)
            rid, op, fields = validate_request(msg)
            if op not in OPEN_OPS and not self.auth.accepts(msg.get("auth")):
                raise ValidationError(ErrorCode.UNAUTHORIZED, "this server needs its API token ('auth' field; "
                                                              "clients read $KVSERVER_API_TOKEN or the token file)")
            if frames and op not in DATA_OPS:
                raise ValidationError(ErrorCode.BAD_FIELD, f"{op} takes no data frames")
            out = self.handlers[op](fields, frames)
            result, data = await out if asyncio.iscoroutine(out) else out  # type: ignore[misc]
            reply = ok_reply(rid, result)
        except ValidationError as exc:
            code = str(exc.code)
            reply, data = error_reply(rid, exc.code, exc.message), []
        except Exception as exc:  # a failing handler must still answer, and the loop must go on
            log.exception("handler for %s failed", op)
            code = str(ErrorCode.INTERNAL)
            reply, data = error_reply(rid, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"[:500]), []
        if code is not None:
            self.errors[code] = self.errors.get(code, 0) + 1
        self.op_counts[op] = self.op_counts.get(op, 0) + 1
        elapsed = time.perf_counter() - started
        for observer in self.observers:
            observer(op, elapsed, code)
        return reply, data

    async def _serve_loop(self) -> None:
        while True:
            parts = await self._sock.recv_multipart(copy=False)
            if len(parts) < 2:
                continue  # a bare identity frame: nothing to answer to
            identity, header = parts[0], parts[1]
            frames = [memoryview(p.buffer) for p in parts[2:]]
            if self.l2 is None:
                await self._answer(identity, header.bytes, frames)
            else:  # a lookup may wait on L2: let other requests run meanwhile (tasks start in FIFO order)
                task = asyncio.create_task(self._answer(identity, header.bytes, frames))
                self._answering.add(task)
                task.add_done_callback(self._answering.discard)

    async def _answer(self, identity: Any, header: bytes, frames: list[memoryview]) -> None:
        reply, data = await self.handle(header, frames)
        try:
            await self._sock.send_multipart([identity, pack(reply), *data], copy=False)
        except zmq.ZMQError as exc:
            log.warning("could not send reply: %s", exc)

    async def _expiry_loop(self) -> None:
        interval = max(0.05, min(1.0, self.config.lease_ttl / 4))
        while True:
            await asyncio.sleep(interval)
            try:
                self.cache.expire()
                self.ec.expire()
            except Exception:  # the sweeper must never die silently
                log.exception("lease expiry sweep failed")

    async def serve(self) -> None:
        if self.l2 is not None:
            await self.l2.start()
        if self.kv_events is not None:
            self.kv_events.start()
        tasks = [asyncio.create_task(self._serve_loop(), name="zmq"),
                 asyncio.create_task(self._expiry_loop(), name="expiry")]
        http_task = asyncio.create_task(self.http.serve(), name="http") if self.http else None
        fleet = fleet_task = None
        if self.config.coordinator:
            from .http.fleet import FleetAgent

            fleet = FleetAgent(self, self.config.coordinator, self.http.port if self.http else None)
            fleet_task = asyncio.create_task(fleet.run(), name="fleet")
        self.ready = True
        try:
            await self._stop.wait()
        finally:
            self.ready = False
            if fleet is not None and fleet_task is not None:  # leave the fleet before going deaf
                fleet_task.cancel()
                await asyncio.gather(fleet_task, return_exceptions=True)
                await fleet.close()
            if http_task is not None:
                await self.http.shutdown(http_task)
            for t in [*tasks, *self._answering]:
                t.cancel()
            await asyncio.gather(*tasks, *self._answering, return_exceptions=True)
            if self.l2 is not None:
                await self.l2.stop()  # flushes the write-behind queue (bounded) before the arena goes
            if self.kv_events is not None:
                await self.kv_events.stop()

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        """Release everything this server created, in reverse order; safe on a half-built server."""
        if self.http is not None:
            self.http.close()
        if getattr(self, "kv_events", None) is not None:
            self.kv_events.close()
        self._sock.close(linger=0)
        self._ctx.term()
        arena: Arena | None = getattr(self, "arena", None)
        if arena is not None:
            arena.close()
        ec_arena: Arena | None = getattr(self, "ec_arena", None)
        if ec_arena is not None:
            ec_arena.close()
        if self._lock is not None:
            self._lock.release()
            self._lock = None

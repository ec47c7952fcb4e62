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
from typing import TYPE_CHECKING, Any

import msgspec
import zmq
import zmq.asyncio

import kvprotocol
from kvprotocol import ValidationError
from kvprotocol._envelope import ErrorEnvelope, OkEnvelope
from kvprotocol._messages import MAX_HEADER_BYTES, decode_request, error_reply, ok_reply
from kvprotocol._replies import PingReply, Reply_
from kvprotocol._requests import Request

from ..service.after_reply import AfterReply
from ..l1.arena import HEADER_BYTES, Arena, ArenaLock, arena_name, check_free_space
from ..security.auth import ServerAuth
from ..blend.index import BlendService
from ..service.cache import CacheService
from ..config import ServerConfig
from .describe import describe_reply, describe_server, describe_tenant, fleet_stats
from ..ec.cache import ECCache, check_ec_space, ec_arena_name
from ..errors import BadField, Forbidden, Unauthorized, internal_error, wire_error
from ..l1.eviction import make_policy
from ..l1.cache import L1Cache
from ..l2 import build_tier_manager
from .latency import LatencyBuckets
from ..security.shm import check_mode
from ..security.tenants import ADMIN, Identity
from .warm import WarmStart
from .zmq_loop import Answer, ZmqLoop

if TYPE_CHECKING:
    from ..http.service import HttpService
    from ..kvevents import EventsSnapshot, KVEvents

log = logging.getLogger("kvserver")
Result = tuple[Reply_, list[Any]]  # the reply Struct (kvprotocol._replies) and its data frames
Handler = Callable[[Any, list[memoryview], Identity], Result | Awaitable[Result]]
OPERATOR_OPS = frozenset({"query", "pin", "unpin"})  # an operator's look at a keyspace, not engine traffic
OPEN_OPS = frozenset({"ping"})  # answered without a token, like the HTTP health probes
HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS = 10_000, 30_000  # ZMTP pings to every peer; silent ones are dropped
ADMIN_OPS = frozenset({"clear", "ec_clear"})  # touch every tenant's objects: the server's own token only


def max_frame_bytes(arena_size: int) -> int:
    """ZMQ_MAXMSGSIZE: the largest object an arena of this size holds, or a header frame."""
    return max(MAX_HEADER_BYTES, min(arena_size, kvprotocol.MAX_OBJECT_BYTES))


class KVServer:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.started = time.time()
        self.http: HttpService | None = None
        self.warm: WarmStart | None = None
        self._built = False  # a half-built server removes its arena on close; a built one leaves it
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
            # A connection that never finishes the ZMTP handshake is closed after idle_timeout, one whose
            # peer stops answering heartbeats after HEARTBEAT_TIMEOUT_MS (an idle engine's libzmq answers
            # them by itself, so engines may idle between requests as long as they like).
            self._sock.setsockopt(zmq.HANDSHAKE_IVL, int(config.idle_timeout * 1000))
            self._sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
            self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
            self.auth.secure(self._sock)
            self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
            try:
                self._sock.bind(config.zmq_url)
            except zmq.ZMQError as exc:
                raise RuntimeError(f"cannot bind {config.zmq_url}: {exc}") from None
            self.auth.publish(config.port)  # only once the port is ours
            check_free_space(name, config.l1_bytes + HEADER_BYTES)
            self.arena = Arena(name, config.l1_bytes, prefault=config.prefault, adopt=not config.cold)
            self.l1 = L1Cache(self.arena, make_policy(config.eviction_policy))
            # the encoder cache: its own segment and budget, never evicted by KV (ec.py)
            check_ec_space(ec_arena_name(name), config.ec_bytes + HEADER_BYTES)
            self.ec_arena = Arena(ec_arena_name(name), config.ec_bytes, prefault=config.prefault, adopt=not config.cold)
            self.ec = ECCache(self.ec_arena, config.lease_ttl, self.auth.tenants)  # per tenant (ec_tenants.py)
            # re-adopts what a stopped server left in both segments
            self.warm = WarmStart(self.arena, self.l1, self.ec_arena, self.ec, self.auth.tenants)
            self.cache = CacheService(self.l1, config.chunk_size, config.lease_ttl, self.auth.tenants)
            self.cache.reservations.lifetime = config.reservation_lifetime
            self.cache.engine_table.ttl = config.engine_ttl
            # content-keyed chunks (CacheBlend), opt-in per request: the same state, keys and admission
            self.blend = BlendService(self.cache.state, self.cache.keys)
            self.l2 = build_tier_manager(config, self.l1)  # None without --l2; ValueError on bad settings
        except BaseException:
            self.close()
            raise
        self._after = AfterReply()  # what a reply need not wait for: run after it, before the next request
        self.cache.defer = self._after.defer
        # the same socket, used without asyncio futures (zmq_loop.py)
        self._zmq = ZmqLoop(zmq.Socket.shadow(self._sock.underlying), self._begin, self._after)
        self.errors: dict[str, int] = {}
        self.op_counts: dict[str, int] = {}
        self.observers: list[Callable[[str, float, str | None], None]] = []  # (op, seconds, error code)
        self.latency = LatencyBuckets()  # describe's "latency": interval p99 for kvcli top
        self.observers.append(self.latency.observe)
        self._engine_ids = itertools.count(1)
        self._stop = asyncio.Event()
        self.handlers: dict[str, Handler] = self._builtin_handlers()
        if self.l2 is not None:
            self.cache.l2 = self.l2
            self.cache.on_commit.append(self.l2.committed)
            if self.l2.wants_hits:
                self.cache.on_hit.append(self.l2.hit)
            self.handlers["lookup"] = self._lookup_l2
            self.handlers["query"] = self._query_l2
        self.kv_events: KVEvents | None = None
        if config.kv_events_endpoint:
            from ..kvevents import KVEvents

            try:
                self.kv_events = KVEvents(config, self.l1, self.cache, self.l2, token=self.auth.token)
            except Exception:
                self.close()
                raise
        self.ready = False  # true while the control plane serves (the HTTP /readyz answer)
        if config.http_port:
            from ..http.service import HttpService  # FastAPI is only imported when the API is on

            try:
                self.http = HttpService(self)
                self.auth.publish(self.http.port)
            except Exception:
                self.close()
                raise
        self._built = True

    # -- ops -------------------------------------------------------------------------------------
    def _builtin_handlers(self) -> dict[str, Handler]:
        """op -> handler(typed request, data frames, sender's identity)."""
        c = self.cache
        return {
            "ping": lambda r, fr, w: (PingReply(kvprotocol.__version__, kvprotocol.PROTOCOL_VERSION, time.time()), []),
            "describe": lambda r, fr, w: (describe_reply(self) if w.admin else describe_tenant(self, w), []),
            "register_engine": lambda r, fr, w: (
                c.register_engine(r, f"eng-{os.getpid()}-{next(self._engine_ids)}", w),
                [],
            ),
            "lookup": lambda r, fr, w: (c.lookup(r, w), []),
            "query": lambda r, fr, w: (c.query(r, w), []),
            "announce": lambda r, fr, w: (c.announce(r, w), []),
            "store": lambda r, fr, w: (c.store(r, w), []),
            "commit": lambda r, fr, w: (c.commit(r.store_id, fr, r.checksums, w), []),
            "abort": lambda r, fr, w: (c.abort(r.store_id, w), []),
            "retrieve": lambda r, fr, w: c.retrieve(r, w),
            "release": self._release,
            "end_session": lambda r, fr, w: (c.end_session(r.session, w), []),
            "clear": lambda r, fr, w: (c.clear(), []),
            "pin": lambda r, fr, w: (c.set_pinned(r, True, w), []),
            "unpin": lambda r, fr, w: (c.set_pinned(r, False, w), []),
            **self.ec.handlers(),
            "blend_store": lambda r, fr, w: (self.blend.store(r, w), []),
            "blend_lookup": lambda r, fr, w: (self.blend.lookup(r, w), []),
        }

    def _release(self, r: Any, _frames: list[memoryview], who: Identity) -> Result | Awaitable[Result]:
        out = self.cache.release(r, who)
        if not isinstance(out, Awaitable):
            return out, []

        async def checked() -> Result:  # it reported corrupt chunks: answered once they are checked
            return await out, []

        return checked()

    async def _lookup_l2(self, r: Any, _frames: list[memoryview], who: Identity) -> Result:
        return await self.cache.lookup_l2(r, who), []

    async def _query_l2(self, r: Any, _frames: list[memoryview], who: Identity) -> Result:
        return await self.cache.query_l2(r, who), []

    # -- what the HTTP layer sees (http/backend.py's AdminBackend) -----------------------------------
    def describe(self) -> dict[str, Any]:
        """Everything an operator may see (the server's token), as a map: see describe.py."""
        return describe_server(self)

    @property
    def api_token(self) -> str:
        return self.auth.token

    def fleet_stats(self) -> dict[str, Any]:
        return fleet_stats(self)

    def kv_events_snapshot(self) -> EventsSnapshot | None:
        return None if self.kv_events is None else self.kv_events.snapshot()

    # -- dispatch --------------------------------------------------------------------------------
    def _begin(self, header_frame: bytes, frames: list[memoryview]) -> Answer | Awaitable[Answer]:
        """Decode, authenticate and run one request: its answer, or an awaitable of it when the handler
        waits (an L2 lookup). Never raises: every failure is an error reply, counted."""
        self._after.run()  # (normally empty already) every request sees all earlier ones' effects
        started = time.perf_counter()
        rid, op = 0, "invalid"
        reply: OkEnvelope | ErrorEnvelope
        try:
            rid, req = decode_request(header_frame)
            op = req.op_name()
            who = self.auth.identify(req.auth)
            if who is None:
                if op not in OPEN_OPS:
                    raise Unauthorized(
                        "this server needs an API token ('auth' field; "
                        "clients read $KVSERVER_API_TOKEN or the token file)"
                    )
                who = Identity("default")
            out = self._start(req, frames, who)
            if not isinstance(out, tuple):  # a handler that waits (an L2 lookup) gave an awaitable
                return self._finish(out, rid, op, started)
            result, data = out
            reply = ok_reply(rid, result)
        except Exception as exc:  # a failing handler must still answer, and the loop must go on
            if isinstance(exc, ValidationError):  # undecodable: the decoder read what id it could
                rid = rid or exc.rid
            reply, data = self._failed(rid, op, exc, started), []
        else:
            self._account(op, started, None)
        return reply, data

    async def _finish(self, pending: Awaitable[Result], rid: int, op: str, started: float) -> Answer:
        reply: OkEnvelope | ErrorEnvelope
        try:
            result, data = await pending
            reply = ok_reply(rid, result)
        except Exception as exc:
            reply, data = self._failed(rid, op, exc, started), []
        else:
            self._account(op, started, None)
        return reply, data

    async def execute(self, req: Request, who: Identity = ADMIN) -> dict[str, Any]:
        """HTTP: run one already-authenticated request through the same handlers and the same accounting
        (ops, errors, latency) as the control plane; raises what the handler raised (errors.py). The
        reply Struct comes back as the map the ZMQ reply encodes (JSON takes maps)."""
        started = time.perf_counter()
        op = req.op_name()
        try:
            out = self._start(req, [], who)
            result, _ = out if isinstance(out, tuple) else await out
        except Exception as exc:
            self._failed(0, op, exc, started)
            raise
        else:
            self._account(op, started, None)
        finally:
            self._after.run()
        as_map: dict[str, Any] = msgspec.to_builtins(result)
        return as_map

    def count_refused(self, op: str, exc: Exception) -> None:
        """HTTP: a body refused before it became a request still counts as an error of its op."""
        if wire_error(exc) is not None:
            self._failed(0, op, exc, time.perf_counter())
            self._after.run()

    def _start(self, req: Request, frames: list[memoryview], who: Identity) -> Result | Awaitable[Result]:
        """The checks every op passes, then its handler: a result, or a coroutine for a waiting one."""
        op = req.op_name()
        if op in ADMIN_OPS and not who.admin:
            raise Forbidden(f"{op} is an admin op: it needs the server's own token, not a tenant's")
        if frames and not req.DATA_IN:
            raise BadField(f"{op} takes no data frames")
        check_mode(op, req, who)  # shm mode maps the whole arena: only for identities allowed it (shm.py)
        keyspace = getattr(req, "keyspace", None)
        model, world = getattr(keyspace, "model", None), getattr(keyspace, "world_size", None)
        if isinstance(model, str) and isinstance(world, int) and op not in OPERATOR_OPS:
            self.cache.engine_table.touch(model, world)  # its engines are alive (engine expiry, engines.py)
        return self.handlers[op](req, frames, who)

    def _failed(self, rid: int, op: str, exc: Exception, started: float) -> ErrorEnvelope:
        """Count one failed request and build its error reply: the one place ZMQ maps errors to codes."""
        expected = wire_error(exc)
        if expected is None:
            log.exception("handler for %s failed", op, exc_info=exc)
        code, message = expected or internal_error(exc)
        self.errors[str(code)] = self.errors.get(str(code), 0) + 1
        self._account(op, started, str(code))
        return error_reply(rid, code, message)

    def _account(self, op: str, started: float, code: str | None) -> None:
        """Count one answered request; its latency (up to its reply) is observed after the reply."""
        self.op_counts[op] = self.op_counts.get(op, 0) + 1
        elapsed = time.perf_counter() - started
        self._after.defer(lambda: self._observe(op, elapsed, code))

    def _observe(self, op: str, elapsed: float, code: str | None) -> None:
        for observer in self.observers:
            observer(op, elapsed, code)

    async def _expiry_loop(self) -> None:
        interval = max(0.05, min(1.0, self.config.lease_ttl / 4))
        swept = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            try:
                self.cache.expire()
                self.ec.expire()
                if time.monotonic() - swept >= 1.0:  # exited engines leave describe and the gauge
                    swept = time.monotonic()
                    self.cache.engine_table.expire()
            except Exception:  # the sweeper must never die silently
                log.exception("lease expiry sweep failed")

    async def serve(self) -> None:
        if self.l2 is not None:
            await self.l2.start()
        if self.kv_events is not None:
            self.kv_events.start()
        tasks = [
            asyncio.create_task(self._zmq.run(), name="zmq"),
            asyncio.create_task(self._expiry_loop(), name="expiry"),
        ]
        if self.warm is not None:
            tasks.append(asyncio.create_task(self.warm.run(), name="adopt"))
        http = self.http
        http_task = asyncio.create_task(http.serve(), name="http") if http is not None else None
        fleet = fleet_task = None
        if self.config.coordinator:
            from ..http.fleet import FleetAgent

            fleet = FleetAgent(self, self.config.coordinator, http.port if http is not None else None)
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
            if http is not None and http_task is not None:
                await http.shutdown(http_task)
            for t in [*tasks, *self._zmq.answering]:
                t.cancel()
            await asyncio.gather(*tasks, *self._zmq.answering, return_exceptions=True)
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
        events: KVEvents | None = getattr(self, "kv_events", None)
        if events is not None:
            events.close()
        self._sock.close(linger=0)
        self._ctx.term()
        arena: Arena | None = getattr(self, "arena", None)
        # a server that started leaves its arena for the next one on this port to adopt (warm.py), and
        # so does one that failed to start on an arena it adopted (never throw a cache away by mistake);
        # an arena this server created and never served from goes
        ec_arena: Arena | None = getattr(self, "ec_arena", None)
        keep = self._built or (arena is not None and arena.adopted) or (ec_arena is not None and ec_arena.adopted)
        if self.warm is not None:
            self.warm.close(keep=keep)
        if arena is not None:
            arena.close(keep=keep)
        if ec_arena is not None:
            ec_arena.close(keep=keep)
        if self._lock is not None:
            self._lock.release()
            self._lock = None

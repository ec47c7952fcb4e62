"""The EngineClient's connection to one kvserver: calls under a deadline, reconnects, registration
and the shm arena mapping.

Why: an engine must never hang or crash because the cache server is slow, gone or restarted. Every
call runs under the deadline of the API call that made it; a call that times out throws its DEALER
socket away (so a stale request queued in it can never reach a restarted server) and makes further
calls fail fast for a short back-off instead of stalling every forward pass. A restart is noticed by
the arena's file identity (shm), or by the server no longer knowing our layouts (LAYOUT_MISMATCH);
either way the engine registers again and maps the new arena.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar
from urllib.parse import urlsplit

import zmq
from kvprotocol import (
    Backoff,
    Client,
    ErrorCode,
    GroupGeometry,
    KeySpace,
    KVProtocolError,
    LayoutDescriptor,
    RequestTimeout,
    ServerError,
)
from kvprotocol._replies import Reply_
from kvprotocol._requests import LayoutW, RegisterEngine, Request
from kvprotocol._shm import ShmMapping as ArenaMap
from kvprotocol._shm import shm_exists


R = TypeVar("R")
Rep = TypeVar("Rep", bound=Reply_)  # the reply Struct of a typed request (kvprotocol.requests)


class SharedArenas:
    """One mapping of a server's arena per process, however many EngineClients copy through it.

    Why: a vLLM worker has two clients (the step's and the background loader's). Sharing the
    mapping halves its page tables and, on a GPU, makes the arena registered for DMA once per process
    (`_torch_copy.HostPins` counts its users by address). A mapping is shared only while its file is
    the one named and its header carries the nonce the caller registered under; the last user closes
    it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._maps: dict[int, tuple[ArenaMap, int]] = {}  # id(mapping) -> (mapping, users)

    def acquire(self, name: str, size: int, nonce: str) -> tuple[ArenaMap, bool]:
        """(a mapping of /dev/shm/<name> whose header says `nonce` if one is open here, else a new
        one; whether it is new). The caller checks a new mapping's nonce and releases it if wrong."""
        with self._lock:
            for key, (arena, users) in self._maps.items():
                if (arena.name, arena.size) == (name, size) and arena.is_current() and arena.nonce() == nonce:
                    self._maps[key] = (arena, users + 1)
                    return arena, False
            arena = ArenaMap(name, size)
            self._maps[id(arena)] = (arena, 1)
            return arena, True

    def release(self, arena: ArenaMap) -> None:
        with self._lock:
            entry = self._maps.get(id(arena))
            if entry is None or entry[0] is not arena:
                return
            if entry[1] > 1:
                self._maps[id(arena)] = (arena, entry[1] - 1)
                return
            del self._maps[id(arena)]
        arena.close()

    def users(self, arena: ArenaMap) -> int:
        with self._lock:
            entry = self._maps.get(id(arena))
            return entry[1] if entry is not None and entry[0] is arena else 0


ARENAS = SharedArenas()

MODES = ("auto", "shm", "tcp")


class EngineError(KVProtocolError):
    """Base of the engine side's own failures (under kvprotocol's one client-side base); `kind` names it."""


class Unavailable(EngineError):
    """The server did not answer recently; calls fail fast until the back-off ends."""

    KIND = "unavailable"

    def __init__(self, op: str, url: str, retry_in: float) -> None:
        super().__init__(f"{op}: server {url} did not answer recently; retrying in {retry_in:.1f}s")
        self.op, self.url, self.retry_in = op, url, retry_in


class ArenaChanged(EngineError):
    """The shm arena was recreated (server restart) while an operation was using it."""

    KIND = "arena_changed"

    def __init__(self, message: str, arena: str | None = None) -> None:
        super().__init__(message)
        self.arena = arena  # the /dev/shm name that no longer leads to the server's arena, where known


class ShmRefused(EngineError):
    """mode "shm" was asked for, but the server offers this tenant no arena (not added with
    `kvserver tenant add --allow-shm`): use mode "tcp" or "auto"."""

    KIND = "shm_refused"


class LeaseLost(EngineError):
    """The server dropped this rank's leases before its copy finished: the bytes may be foreign."""

    KIND = "lease_lost"


class ArenaUser(Protocol):
    """What must know when the arena mapping changes (the copier: e.g. it pins the arena for DMA).
    Passed to the calls that may remap, never kept: the link does not know who copies."""

    def attach_arena(self, addr: int, size: int) -> None: ...

    def detach_arena(self) -> None: ...


class Deadline:
    """The time left to one API call; every server call inside it gets only what remains."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def remaining(self) -> float:
        return self.end - time.monotonic()


def grace(deadline: Deadline) -> Deadline:
    """What a call that must reach the server whatever happened (a release, an abort) still gets:
    the deadline's rest, at least 0.1 s (after a stall the deadline is long past)."""
    return Deadline(max(deadline.remaining(), 0.1))


def is_local_url(url: str) -> bool:
    """Is the server on this host (loopback, ipc://, or one of this host's addresses)?"""
    if url.startswith(("ipc://", "inproc://")):
        return True
    host = (urlsplit(url).hostname or "").strip("[]")
    if host in ("localhost", "*", "0.0.0.0", "::"):
        return True
    try:
        if ipaddress.ip_address(host).is_loopback:
            return True
    except ValueError:
        pass
    try:
        name = socket.gethostname()
        mine = {info[4][0] for info in socket.getaddrinfo(name, None)} | {name}
    except OSError:
        return False
    return host in mine


class ServerLink:
    """One DEALER client that is recreated after a timeout, with fail-fast back-off."""

    def __init__(self, url: str, backoff: float, token: str | None = None) -> None:
        self.url = url
        self.backoff = Backoff(backoff, backoff)  # a fixed delay: the breaker above doubles
        self.token = token  # a tenant's token; None: $KVSERVER_API_TOKEN or the server's default token file
        self._client: Client | None = None

    def send(self, req: Request[Rep], deadline: Deadline, frames: Sequence[Any] = ()) -> tuple[Rep, list[memoryview]]:
        """A typed request (kvprotocol.requests); returns its reply Struct and data frames."""
        return self._guarded(req.op_name(), deadline, lambda c, t: c.send(req, frames, timeout=t))

    def _guarded(self, op: str, deadline: Deadline, run: Callable[[Client, float], R]) -> R:
        wait = self.backoff.remaining()
        if wait > 0:
            raise Unavailable(op, self.url, wait)
        remaining = deadline.remaining()
        if remaining <= 0:
            raise RequestTimeout(f"{op}: the operation ran out of time")
        if self._client is None:
            self._client = Client(self.url, timeout=remaining, token=self.token)
        try:
            return run(self._client, remaining)
        except RequestTimeout:
            self.reset()
            self.backoff.failed()
            raise
        except ServerError as exc:
            if exc.code == ErrorCode.UNAUTHORIZED:
                self.reset()  # the next client re-reads the token (a restarted server may have a new one)
            raise
        except zmq.ZMQError:
            self.reset()
            raise

    def reset(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def close(self) -> None:
        self.reset()


@dataclass(frozen=True)
class Registration:
    engine_id: str
    arena_name: str
    arena_size: int
    chunk_size: int
    arena_nonce: str = ""
    tails: bool = False  # the server stores and finds tails (partial last chunks)


class EngineLink:
    """Registration and data-plane mode of one engine rank; the arena mapping in shm mode."""

    def __init__(
        self,
        url: str,
        model: str,
        world_size: int,
        rank: int,
        layouts: Sequence[LayoutDescriptor],
        mode: str,
        backoff: float,
        token: str | None = None,
        populate: bool = True,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.server = ServerLink(url, backoff, token)
        self.model, self.world_size, self.rank = model, world_size, rank
        self.layouts = list(layouts)
        self.keyspace = KeySpace.from_layouts(model, world_size, self.layouts)
        self.keyspace_wire = self.keyspace.wire()  # built once: every lookup and store carries it
        self.unit = min(lay.chunk_size for lay in self.layouts)  # tokens per chunk hash (kvprotocol._geometry)
        self.geoms = [GroupGeometry.of(lay, self.unit) for lay in self.layouts]
        self.trivial = all(g.trivial for g in self.geoms)
        self.requested_mode = mode
        self.local = is_local_url(url)
        self.registration: Registration | None = None
        self.arena: ArenaMap | None = None
        self.populate = populate  # fill a new mapping's page tables in the background (ShmMapping.populate)

    def send(self, req: Request[Rep], deadline: Deadline, frames: Sequence[Any] = ()) -> tuple[Rep, list[memoryview]]:
        return self.server.send(req, deadline, frames)

    def sender(self, deadline: Deadline) -> Callable[[Request, Sequence[Any]], tuple[Reply_, list[memoryview]]]:
        """`send` bound to one deadline: what kvprotocol.flows takes."""
        return lambda req, frames: self.server.send(req, deadline, frames)

    def invalidate(self) -> None:
        """Forget the registration (the server may have restarted); the next operation registers."""
        self.registration = None

    def _register(self, deadline: Deadline) -> Registration:
        reply = self.send(
            RegisterEngine(
                model=self.model,
                world_size=self.world_size,
                rank=self.rank,
                groups=[LayoutW(**lay.to_wire()) for lay in self.layouts],
                host=socket.gethostname()[:255] or "unknown",
                pid=os.getpid(),
            ),
            deadline,
        )[0]
        if reply.chunk_size != self.unit:
            raise ValueError(f"server chunk_size {reply.chunk_size} differs from the layouts' smallest chunk_size")
        return Registration(
            reply.engine_id, reply.arena.name, reply.arena.size, reply.chunk_size, reply.arena.nonce, reply.tails
        )

    @property
    def tails(self) -> bool | None:
        """Whether this engine's objects may have tails (the server takes them, every group is plain
        full attention); None before registration."""
        reg = self.registration
        return None if reg is None else reg.tails and self.trivial

    def ensure(self, deadline: Deadline, user: ArenaUser | None = None) -> str:
        """Register if needed and make sure the arena mapping is current; returns "shm" or "tcp".
        `user` lets go of an arena before it is unmapped and is given a newly mapped one."""
        mapped, known = self.arena, self.registration
        if mapped is not None and (
            not mapped.is_current() or (known is not None and mapped.nonce() != known.arena_nonce)
        ):
            # a restart: another arena file, or ours adopted by a new server (a warm restart stamps a
            # new nonce into the same file); our registration predates it, so register again
            self.invalidate()
        if self.registration is None:
            self.registration = self._register(deadline)
        reg = self.registration
        mode = self.requested_mode
        if mode == "shm" and not reg.arena_name:
            raise ShmRefused(
                f"server {self.server.url} offers this tenant no shm arena (the operator must add it with "
                "'kvserver tenant add --allow-shm'); set mode 'tcp' or 'auto'"
            )
        if mode == "auto":
            mode = "shm" if self.local and reg.arena_name and shm_exists(reg.arena_name) else "tcp"
        if mode == "tcp":
            return mode
        arena = self.arena
        if (
            arena is None
            or not arena.is_current()
            or (arena.name, arena.size) != (reg.arena_name, reg.arena_size)
            or arena.nonce() != reg.arena_nonce
        ):
            self._unmap(user)
            try:
                self.arena = self._map(deadline)
            except (OSError, ValueError, ArenaChanged):
                if self.requested_mode == "shm":
                    raise
                return "tcp"  # auto: the arena is not mappable from here (another container, permissions)
            if user is not None:
                user.attach_arena(self.arena.address, self.arena.size)
        return mode

    def _map(self, deadline: Deadline) -> ArenaMap:
        """Map the registered arena and prove it is the server's (its header nonce); a mismatch means
        our registration predates a restart, so register once more before giving up."""
        for attempt in range(2):
            reg = self.registration
            assert reg is not None
            arena, new = ARENAS.acquire(reg.arena_name, reg.arena_size, reg.arena_nonce)
            if reg.arena_nonce and arena.nonce() == reg.arena_nonce:
                if new and self.populate:
                    arena.populate_in_background()  # first copies through it do not fault (kvprotocol._shm)
                return arena
            ARENAS.release(arena)
            if attempt == 0:
                self.registration = self._register(deadline)
        raise ArenaChanged(f"/dev/shm/{arena.name} is not the arena of the server at {self.server.url}", arena.name)

    def check_arena(self) -> None:
        """Raise ArenaChanged when the arena we copied through is no longer the server's."""
        reg = self.registration
        if self.arena is None or not self.arena.is_current() or reg is None or self.arena.nonce() != reg.arena_nonce:
            self.invalidate()
            raise ArenaChanged(
                "the shm arena changed during the operation (a server restart, or the name "
                "no longer leads to this server's arena)",
                None if reg is None else reg.arena_name,
            )

    def _unmap(self, user: ArenaUser | None) -> None:
        if self.arena is not None:
            if user is not None:
                user.detach_arena()
            ARENAS.release(self.arena)
            self.arena = None

    def close(self, user: ArenaUser | None = None) -> None:
        self._unmap(user)
        self.server.close()

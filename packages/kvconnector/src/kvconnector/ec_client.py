"""Engine-side client of the kvserver's encoder cache (EC): save and load one encoder output per item.

Why engine-agnostic and torch-free: an encoder output crosses the wire as opaque bytes plus its dtype
name and shape; turning it back into a tensor is the engine connector's job (vllm/ec_connector.py).
Every failure is a miss (None/False), never an exception: the engine then runs its encoder.

Data modes: "shm" copies through the server's EC segment (mapped here, checked by its instance
nonce), "tcp" sends the bytes as a frame, "auto" uses shm when the segment is visible from this
host and tcp otherwise. Every load verifies the kvsum64 checksum the writer committed, on the
bytes it hands back (after the copy), so a torn or foreign write is a miss, never wrong output.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NotRequired, TypedDict, TypeVar

import numpy as np

from kvprotocol import Client, ErrorCode, KVProtocolError, ServerError
from kvprotocol._replies import ArenaInfo, ECObject
from kvprotocol._shm import ShmMapping as ArenaMap
from kvprotocol._shm import shm_exists

from .copy import checksum_bytes
from .vllm.breaker import Breaker

T = TypeVar("T")

log = logging.getLogger("kvconnector.ec")


class ArenaWire(TypedDict):
    name: str
    size: int
    nonce: str


class ECDescriptor(TypedDict):
    """A cached item as `lookup` found it (the server's ECObject, plus the arena its offset is in);
    a plain map, so it travels in vLLM's connector metadata as it is."""

    size: int
    dtype: str
    shape: list[int]
    checksum: int
    offset: NotRequired[int]  # shm identities only
    lease: NotRequired[str]  # a leased lookup (readers > 0) only
    arena: NotRequired[ArenaWire]


def _arena_wire(arena: ArenaInfo) -> ArenaWire:
    return ArenaWire(name=arena.name, size=arena.size, nonce=arena.nonce)


def _descriptor(obj: ECObject, arena: ArenaInfo) -> ECDescriptor:
    d = ECDescriptor(size=obj.size, dtype=obj.dtype, shape=list(obj.shape), checksum=obj.checksum)
    if obj.offset is not None:
        d["offset"] = obj.offset
    if obj.lease is not None:
        d["lease"] = obj.lease
    d["arena"] = _arena_wire(arena)
    return d


@dataclass
class ECStats:
    lookups: int = 0
    hits: int = 0
    loads: int = 0
    loaded_bytes: int = 0
    saves: int = 0
    saved_bytes: int = 0
    present: int = 0  # saves the server already held (another engine or rank stored it first)
    failures: int = 0  # server calls that failed (the engine encoded instead)
    bad_checksums: int = 0  # loads whose bytes did not match: dropped, never used


class ECClient:
    """One engine's EC channel: key (model, space), mode, and a lazily mapped EC segment."""

    def __init__(
        self,
        url: str,
        model: str,
        space: str,
        mode: str = "auto",
        timeout: float = 5.0,
        retry_after_s: float = 2.0,
        token: str | None = None,
    ) -> None:
        if mode not in ("auto", "shm", "tcp"):
            raise ValueError(f"mode must be auto, shm or tcp, not {mode!r}")
        self.url, self.model, self.space, self.mode = url, model, space, mode
        self._client = Client(url, timeout=timeout, token=token)  # None: $KVSERVER_API_TOKEN, the token file
        self._breaker = Breaker(retry_after_s)
        self._seg: ArenaMap | None = None
        self._shm_ok = mode != "tcp"
        self.stats = ECStats()

    # -- plumbing ------------------------------------------------------------------------------
    def _call(self, op: str, run: Callable[[Client], T]) -> T | None:
        """One typed server call, or None after a failure (counted; the breaker then skips the server a while)."""
        if not self._breaker.allow():
            return None
        try:
            reply = run(self._client)
        except KVProtocolError as exc:
            if self._shm_refused(exc):
                return None
            self.stats.failures += 1
            self._breaker.failed()
            log.warning("kvserver EC %s failed (%s: %s); encoding instead", op, type(exc).__name__, exc)
            return None
        self._breaker.succeeded()
        return reply

    def _segment(self, arena: ArenaWire | None) -> ArenaMap | None:
        """The mapped EC segment the reply names, if it is visible here and is that server's (nonce)."""
        if not self._shm_ok or arena is None:
            return None
        seg = self._seg
        if seg is not None and (
            seg.name != arena.get("name") or not seg.is_current() or seg.nonce() != arena.get("nonce")
        ):
            seg.close()
            self._seg = seg = None
        if seg is None:
            name, size = arena.get("name"), arena.get("size")
            if not isinstance(name, str) or not isinstance(size, int) or not shm_exists(name):
                if self.mode == "auto":
                    self._shm_ok = False  # the server is on another host: tcp from now on
                return None
            try:
                seg = ArenaMap(name, size)
            except (OSError, ValueError):
                self._shm_ok = self.mode == "shm"
                return None
            if seg.nonce() != arena.get("nonce"):
                seg.close()
                return None
            seg.populate_in_background()  # first copies through it do not fault (kvprotocol._shm)
            self._seg = seg
        return seg

    def _shm_refused(self, exc: KVProtocolError) -> bool:
        """In auto mode, an shm op the server refuses to this tenant (FORBIDDEN: not added with
        --allow-shm) switches this client to tcp for good, without tripping the breaker."""
        if self.mode != "auto" or not self._shm_ok:
            return False
        if not isinstance(exc, ServerError) or exc.code != ErrorCode.FORBIDDEN:
            return False
        self._shm_ok = False
        log.info("kvserver refuses shm mode to this tenant (%s); using tcp", exc.message)
        return True

    # -- ops -----------------------------------------------------------------------------------
    def lookup(self, items: list[str], readers: int = 0) -> list[ECDescriptor | None]:
        """Per item: None (miss) or its descriptor; with readers > 0 each hit is leased until released."""
        self.stats.lookups += 1
        reply = self._call(
            "ec_lookup",
            lambda c: c.ec_lookup(model=self.model, space=self.space, items=list(items), readers=readers or None),
        )
        if reply is None:
            return [None] * len(items)
        out = [None if obj is None else _descriptor(obj, reply.arena) for obj in reply.items]
        self.stats.hits += sum(d is not None for d in out)
        return out

    def save(self, item: str, data: np.ndarray, dtype: str, shape: list[int]) -> bool:
        """Store one encoder output (a C-contiguous array of its bytes); False when not stored."""
        buf = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        size = int(buf.nbytes)
        mode: Literal["shm", "tcp"] = "shm" if self._shm_ok else "tcp"
        r = self._call(
            "ec_store",
            lambda c: c.ec_store(
                model=self.model, space=self.space, item=item, dtype=dtype, shape=list(shape), size=size, mode=mode
            ),
        )
        if r is None:  # an shm store refused to this tenant (auto mode): the same store over tcp
            return mode == "shm" and not self._shm_ok and self.save(item, data, dtype, shape)
        if r.status != "reserved" or r.store_id is None:
            self.stats.present += r.status in ("present", "writing")
            return False
        store_id = r.store_id
        checksum = checksum_bytes(buf)
        if mode == "shm":
            seg = self._segment(_arena_wire(r.arena) if r.arena is not None else None)
            if seg is None or r.offset is None:  # not mappable from here after all: give the slot back, send the bytes
                self._call("ec_abort", lambda c: c.ec_abort(store_id=store_id))
                if self.mode == "shm":
                    return False
                return self.save(item, data, dtype, shape)
            seg.check_range(r.offset, size)
            np.frombuffer(seg.mm, np.uint8, size, r.offset)[:] = buf
            ok = self._call("ec_commit", lambda c: c.ec_commit(store_id=store_id, checksum=checksum)) is not None
        else:
            ok = (
                self._call("ec_commit", lambda c: c.ec_commit(store_id=store_id, checksum=checksum, frames=[buf.data]))
                is not None
            )
        if ok:
            self.stats.saves += 1
            self.stats.saved_bytes += size
        return ok

    def load(self, item: str, desc: ECDescriptor | None = None) -> tuple[np.ndarray, str, list[int]] | None:
        """(bytes as uint8 array, dtype, shape) of one item, or None. With a leased descriptor from
        `lookup` the bytes are read straight from the mapped segment (no round trip); otherwise the
        item is retrieved. The checksum is verified on the returned copy."""
        data: np.ndarray | None = None
        if desc is not None and "lease" in desc and "offset" in desc:
            seg = self._segment(desc.get("arena"))
            if seg is not None:
                try:
                    seg.check_range(desc["offset"], desc["size"])
                    data = np.frombuffer(seg.mm, np.uint8, desc["size"], desc["offset"]).copy()
                    if not seg.is_current():
                        data = None
                except ValueError:
                    data = None
        if data is None:
            got = self._call(
                "ec_retrieve", lambda c: c.ec_retrieve(model=self.model, space=self.space, item=item, mode="tcp")
            )
            if got is None or not got[0].found or len(got[1]) != 1:
                return None
            found = got[0]
            if found.size is None or found.dtype is None or found.shape is None or found.checksum is None:
                self.stats.bad_checksums += 1  # found, yet not described: as untrusted as a mismatch
                return None
            desc = ECDescriptor(size=found.size, dtype=found.dtype, shape=found.shape, checksum=found.checksum)
            data = np.frombuffer(got[1][0], np.uint8).copy()
        assert desc is not None
        if data.nbytes != desc["size"] or checksum_bytes(data) != desc["checksum"]:
            self.stats.bad_checksums += 1
            log.error("kvserver EC item %s: bytes do not match their checksum; encoding instead", item)
            return None
        self.stats.loads += 1
        self.stats.loaded_bytes += int(data.nbytes)
        return data, str(desc["dtype"]), [int(x) for x in desc["shape"]]

    def release(self, lease: str) -> None:
        self._call("ec_release", lambda c: c.ec_release(lease=lease))

    def close(self) -> None:
        if self._seg is not None:
            self._seg.close()
            self._seg = None
        self._client.close()

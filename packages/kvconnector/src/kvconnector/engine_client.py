"""EngineClient: the engine-agnostic way for an inference engine to look up, load and save paged KV.

Why this shape: an engine calls it from its scheduler (lookup, release) and from its forward pass
(load, save). Neither may ever hang or crash because of the cache, so every method catches
everything, returns a typed result whose `error` says what went wrong, logs one warning per kind of
failure (rate-limited), and finishes within `timeout`. Reuse must never change a model's output: a
load that fails in any way reports every block of its range as failed, so the engine recomputes.
See docs/engine.md for the full contract.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import zmq
from kvprotocol import (
    ErrorCode,
    ExtraKeys,
    KVProtocolError,
    LayoutDescriptor,
    Pipeline,
    RequestTimeout,
    ServerError,
    validate_model,
    validate_salt,
)
from kvprotocol import replies as rp
from kvprotocol import requests as rq

from ._dataplane import ChecksumMismatch, DataPlane, Prompt
from ._results import LoadResult, LookupResult, SaveResult, as_tables, as_tokens
from ._link import Deadline, EngineLink
from .engine_kv import Copier, EngineKV, HostCopier

if TYPE_CHECKING:
    from ._results import BlockIds, TokenIds
    from .engine_kv import KVTensor, LayerTensors

    # One object group's KV: per-layer tensors (a list, or a dict in layer order) or one stacked tensor
    GroupKV = LayerTensors | Mapping[str, KVTensor]
    KVCaches = GroupKV | Sequence[GroupKV]  # several groups: one GroupKV each, in layout order

log = logging.getLogger("kvconnector.engine_client")

COPY_BACKENDS = ("auto", "host", "torch")
_REREGISTER = (ErrorCode.LAYOUT_MISMATCH, ErrorCode.UNKNOWN_ENGINE)


class _Warner:
    """One warning per failure kind per interval; the count of suppressed ones rides on the next."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warn(self, kind: str, message: str) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, -1e18) < self.interval:
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            return
        self._last[kind] = now
        extra = self._suppressed.pop(kind, 0)
        log.warning("%s%s", message, f" ({extra} similar suppressed)" if extra else "")


def _kind(exc: BaseException) -> str:
    """The short name of a failure: its own `kind` for the client-side tree (kvprotocol's errors and the
    engine's under them), else what a bad argument, a socket or a bug is called."""
    if isinstance(exc, KVProtocolError):
        return exc.kind
    if isinstance(exc, (ValueError, TypeError)):
        return "invalid"
    if isinstance(exc, zmq.ZMQError):
        return "zmq"
    return "internal"


def _layer_list(kv: Any) -> Any:
    return list(kv.values()) if isinstance(kv, dict) else kv


class EngineClient:
    """One engine rank's client of a kvserver (see module docstring and docs/engine.md)."""

    def __init__(
        self,
        url: str,
        model: str,
        world_size: int,
        rank: int,
        layouts: Sequence[LayoutDescriptor],
        mode: str = "auto",
        timeout: float = 5.0,
        *,
        backoff: float | None = None,
        copy_backend: str = "auto",
        num_threads: int = 0,
        warn_interval: float = 30.0,
        token: str | None = None,
        populate_arena: bool = True,
    ) -> None:
        """Configuration errors raise ValueError here (at engine start), never later.

        `token`: the credential (a tenant's token picks the tenant's namespace, quota and caps); None
        reads $KVSERVER_API_TOKEN, else the server's default token file (same user, same host).
        """
        validate_model(model)
        layouts = list(layouts)
        if not layouts:
            raise ValueError("at least one layout (object group) is required")
        unit = min(lay.chunk_size for lay in layouts)
        if any(lay.chunk_size % unit for lay in layouts):  # kvprotocol._geometry: one chunk unit, the smallest
            raise ValueError("every layout's chunk_size must be a multiple of the smallest one")
        if not 0 <= rank < world_size:
            raise ValueError("rank must be in [0, world_size)")
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        if copy_backend not in COPY_BACKENDS:
            raise ValueError(f"copy_backend must be one of {COPY_BACKENDS}")
        self.timeout = timeout
        self.copy_backend = copy_backend
        self.num_threads = num_threads
        self._link = EngineLink(
            url,
            model,
            world_size,
            rank,
            layouts,
            mode,
            min(1.0, timeout) if backoff is None else backoff,
            token,
            populate_arena,
        )
        self._plane = DataPlane(self._link)
        self._lock = threading.RLock()
        self._warner = _Warner(warn_interval)
        self._closed = False
        self._pipe: Pipeline | None = None  # lookup_submit / release(wait=False), created on first use
        self.verify_failures = 0  # loads failed because an object's bytes did not match its checksum
        self.verify_failed_objects = 0

    @property
    def rank(self) -> int:
        return self._link.rank

    @property
    def layouts(self) -> list[LayoutDescriptor]:
        return list(self._link.layouts)

    @property
    def tails(self) -> bool | None:
        """Whether the server this rank registered with takes tails (partial last chunks) of its
        objects; None before registration. A scheduler-side client never registers: the workers tell."""
        return self._link.tails

    @property
    def data_mode(self) -> str | None:
        """ "shm" once the arena is mapped, "tcp" once registered without it, None before."""
        if self._link.registration is None:
            return None
        return "shm" if self._link.arena is not None else "tcp"

    @property
    def copier_name(self) -> str | None:
        """ "host" (the C++ kernel over host KV), "torch-<device>" (the CUDA copier's code; "torch-cuda"
        on a GPU), None before `register`."""
        copier = self._plane.copier
        if copier is None:
            return None
        device = getattr(copier, "device", None)
        return "host" if device is None else f"torch-{device.type}"

    # -- failure handling ---------------------------------------------------------------------------
    def _failed(self, op: str, exc: BaseException) -> str:
        kind = _kind(exc)
        if kind == "timeout" or (isinstance(exc, ServerError) and exc.code in _REREGISTER):
            self._link.invalidate()
        if kind == "internal":
            log.debug("%s failed", op, exc_info=exc)
        self._warner.warn(f"{op}:{kind}", f"kvserver {op} failed ({kind}): {exc}")
        return f"{kind}: {exc}"

    def _deadline(self) -> Deadline:
        if self._closed:
            raise ValueError("the EngineClient is closed")
        return Deadline(self.timeout)

    # -- worker side --------------------------------------------------------------------------------
    def register(self, kv_caches: KVCaches) -> bool:
        """Adopt this rank's KV tensors and register with the server; never raises.

        One object group: a list of per-layer tensors (or a dict of them, in layer order), or one
        stacked tensor. Several groups: a sequence with one such item per group. Returns False when
        the tensors do not match the layouts (loads and saves then fail with an error); a server that
        is down is not a failure here: registration is retried by the next load or save.
        """
        with self._lock:
            try:
                self._deadline()
                self._adopt(kv_caches)
            except Exception as exc:
                self._failed("register", exc)
                return False
            try:
                self._plane.ensure(self._deadline())
            except Exception as exc:
                self._failed("register", exc)
            return True

    def _adopt(self, kv_caches: Any) -> None:
        layouts = self._link.layouts
        groups = [_layer_list(kv_caches)] if len(layouts) == 1 else [_layer_list(g) for g in kv_caches]
        if len(groups) != len(layouts):
            raise ValueError(f"{len(groups)} KV groups for {len(layouts)} layouts")
        first = groups[0] if hasattr(groups[0], "device") else groups[0][0]
        on_cpu = first.device.type == "cpu"
        copier: Copier
        if self.copy_backend == "host" or (self.copy_backend == "auto" and on_cpu):
            copier = HostCopier(
                [EngineKV.from_tensors(lay, g) for lay, g in zip(layouts, groups, strict=True)],
                keepalive=groups,
                num_threads=self.num_threads,
            )
        else:
            from ._torch_copy import TorchCopier

            copier = TorchCopier(layouts, groups)
        self._plane.use(copier)

    def load(
        self,
        session: str,
        tokens: TokenIds,
        block_ids: BlockIds,
        skip_tokens: int,
        num_tokens: int,
        salt: str = "",
        extra: ExtraKeys = (),
    ) -> LoadResult:
        """Write the engine blocks covering tokens [skip_tokens, num_tokens) from the cache.

        `extra` (here and in save/lookup): per-chunk extra keys, (chunk index, 32-byte digest) pairs,
        for what else changes the KV of a chunk (an adapter, multimodal items); see docs/engine.md.

        block_ids are the request's blocks from token 0 (or one such list per group). Blocks before
        skip_tokens (which must be block-aligned) are never written. On any failure ok is False and
        failed_block_ids lists every block of the range: their contents are undefined.

        A load ends this rank's leases of the session (success or not): ok is True only when the
        server confirms they were held until the copy finished. A later load of the same session
        leases this rank's objects again by itself.
        """

        def run(deadline: Deadline, prompt: Prompt, start: int, end: int) -> tuple[int, Exception | None]:
            return start + self._plane.load(deadline, session, prompt, start, end), None

        return self._load(tokens, block_ids, skip_tokens, num_tokens, salt, extra, run)

    def load_streamed(
        self,
        session: str,
        tokens: TokenIds,
        block_ids: BlockIds,
        skip_tokens: int,
        num_tokens: int,
        salt: str = "",
        extra: ExtraKeys = (),
        poll_s: float = 0.002,
    ) -> LoadResult:
        """`load`, for a range the server's L2 prefetch is still bringing into L1 (a lookup answered
        `pending` with `expected_tokens`): chunks are loaded as they land, each verified; the wait
        polls every `poll_s` and lasts at most the client's timeout.

        A chunk that does not land (the prefetch ended without it: an L2 error, a corrupt or vanished
        object, its timeout) fails, and so does every block after it: failed_block_ids lists them,
        ok is False, and loaded_tokens counts the verified blocks before them (which the engine keeps).
        Ends this rank's leases of the session, as `load` does.
        """

        def run(deadline: Deadline, prompt: Prompt, start: int, end: int) -> tuple[int, Exception | None]:
            if poll_s <= 0:
                raise ValueError("poll_s must be positive")
            return self._plane.load_streamed(deadline, session, prompt, start, end, poll_s)

        return self._load(tokens, block_ids, skip_tokens, num_tokens, salt, extra, run)

    def _load(
        self,
        tokens: TokenIds,
        block_ids: BlockIds,
        skip_tokens: int,
        num_tokens: int,
        salt: str,
        extra: ExtraKeys,
        run: Callable[[Deadline, Prompt, int, int], tuple[int, Exception | None]],
    ) -> LoadResult:
        """What `load` and `load_streamed` share: checks, the copy (`run` answers how far the verified
        blocks reach and the error that stopped it, if any), and on failure the blocks from there on."""
        with self._lock:
            tables: list[Any] = []
            start, end = int(skip_tokens), int(num_tokens)
            try:
                deadline = self._deadline()
                tables = as_tables(block_ids, len(self._link.layouts))
                if self._plane.copier is None:
                    raise ValueError("register(kv_caches) must be called before load")
                validate_salt(salt)
                upto, exc = run(deadline, Prompt(as_tokens(tokens), tables, salt, extra), start, end)
            except Exception as err:
                upto, exc = start, err
            if exc is None:
                return LoadResult(True, upto - start, [], None)
            if isinstance(exc, ChecksumMismatch):
                self.verify_failures += 1
                self.verify_failed_objects += exc.objects
            error = self._failed("load", exc)
            try:
                failed = self._plane.load_blocks(tables, upto, end)
            except Exception:
                failed = []
            return LoadResult(False, upto - start, failed, error)

    def save(
        self,
        tokens: TokenIds,
        block_ids: BlockIds,
        salt: str = "",
        skip_tokens: int = 0,
        extra: ExtraKeys = (),
        reservation: str | None = None,
        total_chunks: int | None = None,
        tail: bool = False,
    ) -> SaveResult:
        """Store every full chunk of `tokens` from the chunk holding skip_tokens on; with `tail`, the
        tokens past the last full chunk too, as a tail, where the server takes tails (`tails`).

        block_ids are the request's blocks from token 0; chunks they do not fully cover are skipped.
        ok is False when anything failed or the server had no room for some chunk; no_space tells
        the second case (a full cache, not a failing server) apart.

        With `reservation` (a producer's request id): the first save of it declares `total_chunks`,
        and the server admits the request only when all of them fit; retry_later says it did not fit
        now (nothing stored). Later saves of the request draw on the reservation (docs/pd.md).
        """
        with self._lock:
            try:
                deadline = self._deadline()
                if self._plane.copier is None:
                    raise ValueError("register(kv_caches) must be called before save")
                validate_salt(salt)
                prompt = Prompt(as_tokens(tokens), as_tables(block_ids, len(self._link.layouts)), salt, extra)
                saved = self._plane.save(deadline, prompt, int(skip_tokens), reservation, total_chunks, tail)
            except Exception as exc:
                code = exc.code if isinstance(exc, ServerError) else None
                if isinstance(exc, ServerError) and code == ErrorCode.RETRY_LATER:  # busy, not failing
                    return SaveResult(False, 0, f"server:{code}: {exc.message}", retry_later=True)
                return SaveResult(False, 0, self._failed("save", exc), no_space=code == ErrorCode.NO_SPACE)
            if saved.no_space:
                error = f"server:{ErrorCode.NO_SPACE}: no room for {saved.no_space} chunk(s)"
                self._warner.warn("save:no_space", f"kvserver save incomplete: {error}")
                return SaveResult(False, saved.written, error, saved.cached, no_space=True)
            return SaveResult(True, saved.written, None, saved.cached)

    # -- scheduler side -----------------------------------------------------------------------------
    def lookup(
        self,
        tokens: TokenIds,
        salt: str = "",
        session: str | None = None,
        extra: ExtraKeys = (),
        wait: bool = True,
        expect: bool = False,
        tails: bool = False,
    ) -> LookupResult:
        """Tokens of the longest cached prefix (a multiple of chunk_size; with `tails`, towards a server
        that takes them, it may end in a stored tail inside a chunk); with a session, the hit
        objects of every rank stay leased until each rank's load (or release(session, rank)) gives
        its part back, release(session) gives all back, or the server's lease TTL passes.

        wait=False never waits for the server's L2: the hit is what L1 holds now, and `pending` says
        a prefetch of the rest runs; a later lookup of the same tokens returns the grown hit. With
        expect too, a pending answer waits until that prefetch located its objects and says how far
        L1 + L2 will cover (`expected_tokens`): a `load_streamed` of that range can start at once."""
        with self._lock:
            try:
                deadline = self._deadline()
                validate_salt(salt)
                hit, pending, inflight, expected = self._plane.lookup(
                    deadline, as_tokens(tokens), salt, session, extra, wait=wait, expect=expect, tails=tails
                )
                return LookupResult(hit, None, pending, inflight, expected)
            except Exception as exc:
                return LookupResult(0, self._failed("lookup", exc))

    # -- scheduler side, never blocking longer than asked (a kvprotocol Pipeline of its own) -------------
    def lookup_submit(
        self,
        tokens: TokenIds,
        salt: str = "",
        session: str | None = None,
        extra: ExtraKeys = (),
        wait: bool = True,
        expect: bool = False,
        tails: bool = False,
    ) -> int | LookupResult:
        """Send a lookup and return at once: its id for `lookup_result`, or a LookupResult carrying the
        error when it could not even be sent. Same answer as `lookup`; with `tails` (only towards a
        server that takes them) the hit may end in a stored tail, inside a chunk. Requests of this client's
        pipeline (lookups, `release(wait=False)`) reach the server in the order they were sent."""
        with self._lock:
            try:
                self._deadline()
                validate_salt(salt)
                req = self._plane.lookup_request(
                    as_tokens(tokens), salt, session, extra, wait=wait, expect=expect, tails=tails
                )
                return self._pipeline().submit(req)
            except Exception as exc:
                return LookupResult(0, self._failed("lookup", exc))

    def lookup_result(self, rid: int, wait_s: float = 0.0) -> LookupResult | None:
        """The answer to lookup `rid` once it arrived (waiting at most `wait_s`), None before."""
        with self._lock:
            try:
                got = self._pipeline().result(rid, wait_s)
                if got is None:
                    return None
                hit, pending, inflight, expected = self._plane.lookup_answer(cast(rp.LookupReply, got[0]))
                return LookupResult(hit, None, pending, inflight, expected)
            except Exception as exc:
                if isinstance(exc, ServerError) and exc.code == ErrorCode.UNAUTHORIZED:
                    self._reset_pipeline()  # the next one reads the token again (a restarted server's)
                return LookupResult(0, self._failed("lookup", exc))

    def lookup_forget(self, rid: int) -> None:
        """Nobody will take lookup `rid`'s answer: drop it when it comes."""
        with self._lock:
            self._pipeline().forget(rid)

    def lookup_abandon(self, rid: int) -> LookupResult:
        """Give up on lookup `rid` (no answer in time). The next lookup starts on a fresh socket with
        the token read again (the server may be a restarted one, as the blocking client does after a
        timeout); whatever a late-processed lookup leased expires with the server's lease TTL.
        Returns the timeout as an error."""
        with self._lock:
            self._reset_pipeline()
        return LookupResult(0, self._failed("lookup", RequestTimeout("lookup: no reply within the timeout")))

    def _reset_pipeline(self) -> None:
        if self._pipe is not None:
            self._pipe.close()
            self._pipe = None

    def _pipeline(self) -> Pipeline:
        if self._pipe is None:
            self._pipe = Pipeline(self._link.server.url, self._link.server.token)
        return self._pipe

    def release(self, session: str, rank: int | None = None, *, wait: bool = True) -> None:
        """Return the session's leases: of every rank (the scheduler, for a hit it will not load), or
        of one rank (a worker that will not load its part); a no-op for unknown sessions; never raises.

        wait=False (the scheduler): sent on this client's lookup pipeline and not awaited, so the
        scheduler never stands still for a round trip, and the release reaches the server after the
        lookups that took the leases. wait=True: over the link, answered (DataPlane.release)."""
        with self._lock:
            try:
                r = None if rank is None else int(rank)
                if wait:
                    self._plane.release(self._deadline(), session, r)
                else:
                    self._pipeline().submit(rq.Release(session=session, rank=r), want_reply=False)
            except Exception as exc:
                self._failed("release", exc)

    def announce(
        self, tokens: TokenIds, start_chunk: int, ttl_s: float, *, session: str, salt: str = "", extra: ExtraKeys = ()
    ) -> None:
        """This engine computes the chunks from `start_chunk` on and stores them within `ttl_s`: another
        engine's lookup of them waits instead of computing them too (the server's announcements.py).
        Sent on the lookup pipeline and not awaited; never raises. Only on a pipeline a lookup opened:
        one opened here while the server is away would hold a token the restarted server refuses,
        and fail the next lookup sent on it."""
        with self._lock:
            if self._pipe is None:
                return
            try:
                validate_salt(salt)
                req = self._plane.announce_request(as_tokens(tokens), salt, session, extra, start_chunk, ttl_s)
                self._pipeline().submit(req, want_reply=False)
            except Exception as exc:
                self._failed("announce", exc)

    def round_trip(self) -> float | None:
        """Seconds of one ping to the server (the load planner's calibration); None when it fails."""
        with self._lock:
            try:
                deadline = self._deadline()
                t0 = time.perf_counter()
                self._link.send(rq.Ping(), deadline)
                return time.perf_counter() - t0
            except Exception as exc:
                self._failed("ping", exc)
                return None

    def close(self) -> None:
        """Unmap the arena and close the socket; later calls return errors."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._reset_pipeline()
            try:
                self._plane.close()
            except Exception as exc:
                self._failed("close", exc)
            self._plane.copier = None

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""The two multi-step sequences of the protocol, written once: store -> fill -> commit, and
(lookup ->) retrieve -> copy -> release.

Every writer and reader (the engine connector, `kvcli bench`, the tests) runs these, so the order
that makes them safe lives in one place: a reservation is always committed or aborted; a reader
whose leases were lost or never taken leases again once; a copy out of shared memory is trusted
only if the release proves the leases were held throughout.

Torch-free and transport-agnostic: the caller passes `send` (a typed request and data frames ->
typed reply and data frames: `Client.send`, or an engine link with deadlines) and callbacks that
move the bytes (buffers, arena offsets, device copies: the caller's business).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar, cast

from ._errors import ErrorCode, KVProtocolError, ServerError
from ._replies import Reply_, RetrieveReply, StoreReply, StoreSlot
from ._requests import Abort, BlendStore, Commit, Release, Request, Retrieve, Store

Buffer = bytes | bytearray | memoryview
Send = Callable[[Request, Sequence[Buffer]], tuple[Reply_, list[memoryview]]]
T = TypeVar("T")
LEASE_LOST_CODES = (ErrorCode.UNKNOWN_SESSION, ErrorCode.NOT_LEASED)


class LeaseBroken(KVProtocolError):
    """The reader's leases ended before its copy finished: the copied bytes are not trusted."""

    KIND = "lease_lost"


class CorruptCopy(KVProtocolError):
    """A reader's copy found objects whose bytes do not match their kvsum64: `chunks` holds their
    chunks, which `read_leased`'s release reports so that the server can check and drop them."""

    KIND = "checksum_mismatch"

    def __init__(self, message: str, chunks: Sequence[int]) -> None:
        super().__init__(message)
        self.chunks = sorted(set(chunks))


def store_and_commit(
    send: Send,
    req: Store | BlendStore,
    fill: Callable[[StoreReply, list[StoreSlot]], tuple[Sequence[Buffer], list[int]]],
    abort_send: Send | None = None,
) -> StoreReply:
    """Reserve the missing objects, let `fill` write the reserved slots, commit; abort on any failure.

    `fill(reply, reserved)` copies the bytes (into the arena at `slot.offset` in shm mode, or into
    buffers it returns as data frames in tcp mode) and returns (frames, one kvsum64 per reserved
    slot in slot order): the commit's proof of the write. A reservation that is not committed is
    aborted (best effort; the server also expires it), so nothing stays reserved behind an error.
    """
    reply = cast(StoreReply, send(req, ())[0])
    reserved = [s for s in reply.slots if s.status == "reserved"]
    if not reserved:
        return reply
    if reply.store_id is None:
        raise KVProtocolError("store reply has reserved slots but no store_id")
    try:
        frames, checksums = fill(reply, reserved)
        send(Commit(store_id=reply.store_id, checksums=list(checksums)), frames)
    except BaseException:
        try:
            (abort_send or send)(Abort(store_id=reply.store_id), ())
        except Exception:
            pass
        raise
    return reply


def retrieve_leased(
    send: Send, req: Retrieve, relookup: Callable[[], None] | None = None
) -> tuple[RetrieveReply, list[memoryview]]:
    """retrieve; when the reader holds no leases (expired, or never taken by this rank) and
    `relookup` is given, lease again through it (it raises if the range is no longer cached) and retry once."""
    try:
        reply, frames = send(req, ())
    except ServerError as exc:
        if relookup is None or exc.code not in LEASE_LOST_CODES:
            raise
        relookup()
        reply, frames = send(req, ())
    return cast(RetrieveReply, reply), frames


def read_leased(
    send: Send,
    req: Retrieve,
    copy: Callable[[RetrieveReply, list[memoryview]], T],
    *,
    prove: bool,
    relookup: Callable[[], None] | None = None,
    release_send: Send | None = None,
) -> T:
    """retrieve -> copy -> release of one rank's leased chunks; returns what `copy` returns.

    Always ends this rank's leases of the session. With `prove` (copies out of shared memory), the
    release names the reader's lease number and must come back `intact`, proving no slot was reused
    under the copy; otherwise LeaseBroken. tcp frames are copies taken under the lease: no proof needed.
    A `copy` that raises CorruptCopy has its chunks reported in that release, while the leases hold.
    """
    released = False
    corrupt: list[int] = []
    try:
        reply, frames = retrieve_leased(send, req, relookup)
        try:
            out = copy(reply, frames)
        except CorruptCopy as exc:
            corrupt = exc.chunks
            raise
        if prove:
            rel = send(Release(session=req.session, rank=req.rank, lease=reply.lease), ())[0]
            released = True
            if not getattr(rel, "intact", False):
                raise LeaseBroken(
                    f"the leases of session {req.session!r} ended before rank {req.rank}'s copy "
                    "finished (expired or dropped); the copied bytes are not trusted"
                )
        return out
    finally:
        if not released:
            try:  # best effort: the server also expires leases after its TTL
                (release_send or send)(Release(session=req.session, rank=req.rank, corrupt=corrupt), ())
            except Exception:
                pass

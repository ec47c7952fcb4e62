"""One typed method per op, shared by the sync `Client` and the asyncio `AsyncClient`.

Each method builds its request Struct (kvprotocol._requests) from keyword fields and hands it to
the client's one `_op`; the sync client returns the reply Struct (kvprotocol._replies), the asyncio
client an awaitable of the same reply. So the two clients cannot drift apart: they share this one
table and differ only in how `_op` waits. `retrieve` and `ec_retrieve` also return the data frames
(tcp mode object bytes); `commit` and `ec_commit` take them.

The methods mirror the request Structs field for field (tests/kvprotocol/test_typed_client.py checks
that every op has its method with exactly its Struct's fields). Annotations are the sync ones.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

from . import _requests as rq
from ._replies import (
    AbortReply,
    AnnounceReply,
    BlendLookupReply,
    BlendStoreReply,
    ClearReply,
    CommitReply,
    DescribeReply,
    ECAbortReply,
    ECCommitReply,
    ECLookupReply,
    ECReleaseReply,
    ECRetrieveReply,
    ECStoreReply,
    EndSessionReply,
    LookupReply,
    PingReply,
    PinReply,
    QueryReply,
    RegisterReply,
    ReleaseReply,
    RetrieveReply,
    StoreReply,
)
from ._requests import (
    Checksum,
    Chunk,
    ECItem,
    ECSize,
    ExtraPair,
    Fingerprint,
    KeySpaceW,
    LayoutW,
    Mode,
    Model,
    Rank,
    Salt,
    SessionId,
    StoreId,
    Tokens,
    WorldSize,
)

Buffer = bytes | bytearray | memoryview
SESSION_ID_BYTES = 16  # 128 bits: a session id nobody can guess (the server refuses shorter ones)


def new_session_id() -> str:
    """A fresh 128-bit random session id (22 url-safe chars): what every client we ship uses."""
    return secrets.token_urlsafe(SESSION_ID_BYTES)


class TypedOps:
    """The typed op methods; a client provides `_op(request, frames, timeout, with_frames)`."""

    def _op(self, req: rq.Request, frames: Sequence[Buffer], timeout: float | None, with_frames: bool) -> Any:
        raise NotImplementedError

    def ping(self, *, timeout: float | None = None) -> PingReply:
        return self._op(rq.Ping(), (), timeout, False)

    def describe(self, *, timeout: float | None = None) -> DescribeReply:
        return self._op(rq.Describe(), (), timeout, False)

    def clear(self, *, timeout: float | None = None) -> ClearReply:
        return self._op(rq.Clear(), (), timeout, False)

    def register_engine(
        self,
        *,
        model: Model,
        world_size: WorldSize,
        rank: Rank,
        groups: list[LayoutW],
        host: str | None = None,
        pid: int | None = None,
        timeout: float | None = None,
    ) -> RegisterReply:
        return self._op(
            rq.RegisterEngine(model=model, world_size=world_size, rank=rank, groups=groups, host=host, pid=pid),
            (),
            timeout,
            False,
        )

    def lookup(
        self,
        *,
        keyspace: KeySpaceW,
        tokens: Tokens,
        session: SessionId | None = None,
        rank: Rank | None = None,
        wait: bool = True,
        expect: bool = False,
        progress: bool = False,
        tails: bool = False,
        extra: list[ExtraPair] | None = None,
        salt: Salt = "",
        timeout: float | None = None,
    ) -> LookupReply:
        return self._op(
            rq.Lookup(
                session=session,
                rank=rank,
                wait=wait,
                expect=expect,
                progress=progress,
                tails=tails,
                keyspace=keyspace,
                tokens=tokens,
                extra=extra,
                salt=salt,
            ),
            (),
            timeout,
            False,
        )

    def query(
        self,
        *,
        keyspace: KeySpaceW,
        tokens: Tokens,
        extra: list[ExtraPair] | None = None,
        salt: Salt = "",
        timeout: float | None = None,
    ) -> QueryReply:
        return self._op(rq.Query(keyspace=keyspace, tokens=tokens, extra=extra, salt=salt), (), timeout, False)

    def announce(
        self,
        *,
        keyspace: KeySpaceW,
        tokens: Tokens,
        session: SessionId,
        ttl_s: float,
        start_chunk: Chunk = 0,
        extra: list[ExtraPair] | None = None,
        salt: Salt = "",
        timeout: float | None = None,
    ) -> AnnounceReply:
        req = rq.Announce(
            keyspace=keyspace,
            tokens=tokens,
            session=session,
            ttl_s=ttl_s,
            start_chunk=start_chunk,
            extra=extra,
            salt=salt,
        )
        return self._op(req, (), timeout, False)

    def store(
        self,
        *,
        keyspace: KeySpaceW,
        tokens: Tokens,
        rank: Rank,
        extra: list[ExtraPair] | None = None,
        salt: Salt = "",
        start_chunk: Chunk = 0,
        mode: Mode = "shm",
        session: SessionId | None = None,
        reservation: SessionId | None = None,
        total_chunks: int | None = None,
        tail: bool = False,
        timeout: float | None = None,
    ) -> StoreReply:
        return self._op(
            rq.Store(
                keyspace=keyspace,
                tokens=tokens,
                extra=extra,
                salt=salt,
                rank=rank,
                start_chunk=start_chunk,
                mode=mode,
                session=session,
                reservation=reservation,
                total_chunks=total_chunks,
                tail=tail,
            ),
            (),
            timeout,
            False,
        )

    def commit(
        self,
        *,
        store_id: StoreId,
        checksums: list[Checksum],
        frames: Sequence[Buffer] = (),
        timeout: float | None = None,
    ) -> CommitReply:
        return self._op(rq.Commit(store_id=store_id, checksums=checksums), frames, timeout, False)

    def abort(self, *, store_id: StoreId, timeout: float | None = None) -> AbortReply:
        return self._op(rq.Abort(store_id=store_id), (), timeout, False)

    def retrieve(
        self,
        *,
        session: SessionId,
        rank: Rank,
        start_chunk: Chunk,
        end_chunk: Chunk,
        mode: Mode = "shm",
        timeout: float | None = None,
    ) -> tuple[RetrieveReply, list[memoryview]]:
        return self._op(
            rq.Retrieve(session=session, rank=rank, start_chunk=start_chunk, end_chunk=end_chunk, mode=mode),
            (),
            timeout,
            True,
        )

    def release(
        self,
        *,
        session: SessionId,
        rank: Rank | None = None,
        lease: int | None = None,
        corrupt: Sequence[int] = (),
        timeout: float | None = None,
    ) -> ReleaseReply:
        return self._op(rq.Release(session=session, rank=rank, lease=lease, corrupt=list(corrupt)), (), timeout, False)

    def end_session(self, *, session: SessionId, timeout: float | None = None) -> EndSessionReply:
        return self._op(rq.EndSession(session=session), (), timeout, False)

    def pin(
        self,
        *,
        keyspace: KeySpaceW,
        tokens: Tokens,
        extra: list[ExtraPair] | None = None,
        salt: Salt = "",
        timeout: float | None = None,
    ) -> PinReply:
        return self._op(rq.Pin(keyspace=keyspace, tokens=tokens, extra=extra, salt=salt), (), timeout, False)

    def unpin(
        self,
        *,
        keyspace: KeySpaceW,
        tokens: Tokens,
        extra: list[ExtraPair] | None = None,
        salt: Salt = "",
        timeout: float | None = None,
    ) -> PinReply:
        return self._op(rq.Unpin(keyspace=keyspace, tokens=tokens, extra=extra, salt=salt), (), timeout, False)

    def blend_store(
        self,
        *,
        keyspace: KeySpaceW,
        tokens: Tokens,
        rank: Rank,
        extra: list[ExtraPair] | None = None,
        salt: Salt = "",
        pos_base: int = 0,
        mode: Mode = "shm",
        session: SessionId | None = None,
        timeout: float | None = None,
    ) -> BlendStoreReply:
        return self._op(
            rq.BlendStore(
                keyspace=keyspace,
                tokens=tokens,
                extra=extra,
                salt=salt,
                rank=rank,
                pos_base=pos_base,
                mode=mode,
                session=session,
            ),
            (),
            timeout,
            False,
        )

    def blend_lookup(
        self,
        *,
        keyspace: KeySpaceW,
        tokens: Tokens,
        starts: list[int],
        extra: list[ExtraPair] | None = None,
        salt: Salt = "",
        session: SessionId | None = None,
        rank: Rank | None = None,
        timeout: float | None = None,
    ) -> BlendLookupReply:
        return self._op(
            rq.BlendLookup(
                keyspace=keyspace, tokens=tokens, extra=extra, salt=salt, starts=starts, session=session, rank=rank
            ),
            (),
            timeout,
            False,
        )

    def ec_lookup(
        self,
        *,
        model: Model,
        space: Fingerprint,
        items: list[ECItem],
        readers: int | None = None,
        timeout: float | None = None,
    ) -> ECLookupReply:
        return self._op(rq.ECLookup(model=model, space=space, items=items, readers=readers), (), timeout, False)

    def ec_store(
        self,
        *,
        model: Model,
        space: Fingerprint,
        item: ECItem,
        dtype: str,
        shape: list[ECSize],
        size: ECSize,
        mode: Mode = "shm",
        timeout: float | None = None,
    ) -> ECStoreReply:
        return self._op(
            rq.ECStore(model=model, space=space, item=item, dtype=dtype, shape=shape, size=size, mode=mode),
            (),
            timeout,
            False,
        )

    def ec_commit(
        self, *, store_id: StoreId, checksum: int, frames: Sequence[Buffer] = (), timeout: float | None = None
    ) -> ECCommitReply:
        return self._op(rq.ECCommit(store_id=store_id, checksum=checksum), frames, timeout, False)

    def ec_abort(self, *, store_id: StoreId, timeout: float | None = None) -> ECAbortReply:
        return self._op(rq.ECAbort(store_id=store_id), (), timeout, False)

    def ec_retrieve(
        self, *, model: Model, space: Fingerprint, item: ECItem, mode: Mode = "shm", timeout: float | None = None
    ) -> tuple[ECRetrieveReply, list[memoryview]]:
        return self._op(rq.ECRetrieve(model=model, space=space, item=item, mode=mode), (), timeout, True)

    def ec_release(self, *, lease: str, timeout: float | None = None) -> ECReleaseReply:
        return self._op(rq.ECRelease(lease=lease), (), timeout, False)

    def ec_clear(self, *, timeout: float | None = None) -> ClearReply:
        return self._op(rq.ECClear(), (), timeout, False)

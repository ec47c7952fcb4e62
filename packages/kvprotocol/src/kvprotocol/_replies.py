"""Every reply of the control plane as one msgspec Struct: what the server builds and a typed client gets back.

Replies are decoded leniently (unknown fields are ignored) so that a newer server may add fields
without breaking older clients; a missing or mistyped field is a protocol error on the client side.

On the wire an optional field the server has nothing for is left out, never sent as nil (what the
hand-built reply maps did, and what untyped clients reading `call(...).result` rely on): Structs
with such fields are `omit_defaults`, and every default there means "absent". DescribeReply's two
shapes (the server's token, a tenant's) use `UNSET` instead, since its values may equal a default.
"""

from __future__ import annotations

from typing import cast

import msgspec
from msgspec import UNSET, UnsetType

from ._requests import REQUESTS, R, Request


class Reply_(msgspec.Struct, omit_defaults=True):
    """Base of every reply Struct: a default is never sent (see the module docstring)."""


class PingReply(Reply_):
    version: str
    protocol: int
    time: float


class DescribeReply(Reply_):
    """The server's own token sees everything; a tenant's sees version, uptime, chunk size and its own
    tenant row. Fields one of the two shapes lacks are UNSET (left off the wire): describe.py
    builds it from keywords, so a key the document gains must be named here first."""

    version: str
    protocol: int
    uptime_s: float
    tenants: dict[str, dict[str, object]]  # per-tenant usage, limits and counters
    tenant: str | UnsetType = UNSET  # a tenant's describe: who asked
    chunk_size: int | UnsetType = UNSET  # a tenant's describe (the server's token reads config)
    config: dict[str, object] | UnsetType = UNSET
    l1: dict[str, object] | UnsetType = UNSET
    warm_restart: dict[str, object] | UnsetType | None = UNSET
    engines: list[dict[str, object]] | UnsetType = UNSET
    engines_expired: int | UnsetType = UNSET  # registrations dropped since start (exited, or silent past the TTL)
    layouts: dict[str, int] | UnsetType = UNSET
    sessions: int | UnsetType = UNSET
    stores_in_flight: int | UnsetType = UNSET
    counters: dict[str, int] | UnsetType = UNSET
    hash_memo: dict[str, object] | UnsetType = UNSET
    reservations: dict[str, object] | UnsetType = UNSET
    announcements: dict[str, int] | UnsetType = UNSET  # chunks engines announced they compute now
    ec: dict[str, object] | UnsetType = UNSET
    blend: dict[str, object] | UnsetType = UNSET
    errors: dict[str, int] | UnsetType = UNSET
    ops: dict[str, int] | UnsetType = UNSET
    latency: dict[str, object] | UnsetType = UNSET
    l2: list[dict[str, object]] | UnsetType = UNSET  # with --l2: one map per tier
    l2_queue: dict[str, object] | UnsetType = UNSET  # with --l2
    kv_events: dict[str, object] | UnsetType = UNSET  # with --kv-events


class ClearReply(Reply_):
    removed: int


class ArenaInfo(msgspec.Struct):
    name: str
    size: int
    nonce: str


class RegisterReply(Reply_):
    engine_id: str
    arena: ArenaInfo
    chunk_size: int
    groups: list[str]
    tails: bool = False  # the server stores and finds tails (Store.tail, Lookup.tails)


class LookupReply(Reply_):
    hit_tokens: int
    hit_chunks: int
    num_chunks: int
    chunk_size: int
    pending: bool | None = None  # only with wait=False: an L2 prefetch of the rest runs
    inflight: bool | None = None  # true: a reservation writes, or another session announced, the chunk the hit stops at
    # only with wait=False, expect=True and pending: the tokens L1 + the running prefetch will cover
    # once its loads land (a load may fail: a streamed load re-leases as chunks arrive, l2.md)
    expected_tokens: int | None = None


class AnnounceReply(Reply_):
    announced: int  # chunks now announced by the session (those already stored are not)


class ChunkPresence(msgspec.Struct):
    hash: str
    l1: int
    objects: int


class QueryReply(Reply_):
    chunks: list[dict[str, str | int]]  # ChunkPresence plus one count per L2 tier ("l2" or "l2.<i>")
    prefix_tokens: int
    chunk_size: int


class StoreSlot(msgspec.Struct, omit_defaults=True):
    chunk: int
    group: int
    status: str  # reserved | present | writing | no_space
    size: int | None = None
    offset: int | None = None  # shm mode, reserved slots


class StoreReply(Reply_):
    store_id: str | None
    slots: list[StoreSlot]


class CommitReply(Reply_):
    committed: int


class AbortReply(Reply_):
    aborted: int


class RetrievedObject(msgspec.Struct, omit_defaults=True):
    chunk: int
    group: int
    size: int
    checksum: int
    offset: int | None = None  # shm mode; tcp mode sends the bytes as data frames, in this order


class RetrieveReply(Reply_):
    objects: list[RetrievedObject]
    lease: int


class ReleaseReply(Reply_):
    released: bool
    intact: bool
    dropped: int = 0  # objects of the reported `corrupt` chunks the server found damaged and dropped


class EndSessionReply(Reply_):
    released: bool
    aborted_stores: int


class PinReply(Reply_):
    objects: int


class BlendSlot(StoreSlot, kw_only=True):
    ref_pos: int  # the position the chunk's KV was (or is to be) computed at


class BlendStoreReply(Reply_):
    store_id: str | None
    slots: list[BlendSlot]
    chunk_size: int


class BlendMatch(msgspec.Struct):
    """One matched chunk of a blend lookup: its token offset in the prompt and where its KV was computed."""

    start: int
    ref_pos: int


class BlendLookupReply(Reply_):
    matches: list[BlendMatch]
    candidate_chunks: int
    hit_tokens: int
    chunk_size: int


class ECObject(msgspec.Struct, omit_defaults=True):
    """An encoder output as ec_lookup and ec_retrieve describe it; offset only to shm identities."""

    size: int
    dtype: str
    shape: list[int]
    checksum: int
    offset: int | None = None
    lease: str | None = None


class ECLookupReply(Reply_):
    items: list[ECObject | None]  # per item: null (a miss) or its descriptor
    arena: ArenaInfo


class ECStoreReply(Reply_):
    status: str  # reserved | present | writing | no_space
    store_id: str | None = None
    size: int | None = None
    offset: int | None = None
    arena: ArenaInfo | None = None


class ECCommitReply(Reply_):
    committed: bool


class ECAbortReply(Reply_):
    aborted: bool


class ECRetrieveReply(Reply_):
    """Found: the object's descriptor; tcp mode sends its bytes as one data frame, shm mode leases
    it for one reader (`lease`) and names `offset` in `arena`."""

    found: bool
    size: int | None = None
    dtype: str | None = None
    shape: list[int] | None = None
    checksum: int | None = None
    offset: int | None = None
    lease: str | None = None
    arena: ArenaInfo | None = None


class ECReleaseReply(Reply_):
    released: bool


REPLIES: dict[str, type[Reply_]] = {
    "ping": PingReply,
    "describe": DescribeReply,
    "clear": ClearReply,
    "register_engine": RegisterReply,
    "lookup": LookupReply,
    "query": QueryReply,
    "announce": AnnounceReply,
    "store": StoreReply,
    "commit": CommitReply,
    "abort": AbortReply,
    "retrieve": RetrieveReply,
    "release": ReleaseReply,
    "end_session": EndSessionReply,
    "pin": PinReply,
    "unpin": PinReply,
    "blend_store": BlendStoreReply,
    "blend_lookup": BlendLookupReply,
    "ec_lookup": ECLookupReply,
    "ec_store": ECStoreReply,
    "ec_commit": ECCommitReply,
    "ec_abort": ECAbortReply,
    "ec_retrieve": ECRetrieveReply,
    "ec_release": ECReleaseReply,
    "ec_clear": ClearReply,
}
assert set(REPLIES) == set(REQUESTS), "every op needs a reply Struct"


_DECODERS = {op: msgspec.msgpack.Decoder(cls) for op, cls in REPLIES.items()}


def decode_reply(req: Request[R], result: bytes | msgspec.Raw) -> R:
    """The typed reply of a request from its raw msgpack result, in one decode; raises
    msgspec.DecodeError (ValidationError: a missing or mistyped field)."""
    return cast(R, _DECODERS[req.op_name()].decode(result))

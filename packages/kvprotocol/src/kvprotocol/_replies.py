"""Every reply of the control plane as one msgspec Struct: what a typed client gets back.

Replies are decoded leniently (unknown fields are ignored) so that a newer server may add fields
without breaking older clients; a missing or mistyped field is a protocol error on the client side.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ._requests import REQUESTS, Request


class Reply_(msgspec.Struct):
    """Base of every reply Struct."""


class PingReply(Reply_):
    version: str
    protocol: int
    time: float


class DescribeReply(Reply_):
    """The server's own token sees everything; a tenant's sees version, uptime and its own tenant row."""

    version: str
    protocol: int
    uptime_s: float
    tenants: dict[str, dict[str, Any]] = {}  # per-tenant usage, limits and counters
    tenant: str | None = None  # set when a tenant asked
    l1: dict[str, Any] = {}
    counters: dict[str, int] = {}
    errors: dict[str, int] = {}
    ops: dict[str, int] = {}
    sessions: int = 0
    stores_in_flight: int = 0
    engines: list[dict[str, Any]] = []
    engines_expired: int = 0  # registrations dropped since start (process exited, or silent past the TTL)
    config: dict[str, Any] = {}


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


class LookupReply(Reply_):
    hit_tokens: int
    hit_chunks: int
    num_chunks: int
    chunk_size: int
    pending: bool | None = None  # only with wait=False: an L2 prefetch of the rest runs
    inflight: bool | None = None  # true: a producer's reservation is writing the chunk the hit stops at


class ChunkPresence(msgspec.Struct):
    hash: str
    l1: int
    objects: int


class QueryReply(Reply_):
    chunks: list[dict[str, Any]]  # ChunkPresence plus one count per L2 tier ("l2" or "l2.<i>")
    prefix_tokens: int
    chunk_size: int


class StoreSlot(msgspec.Struct):
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


class RetrievedObject(msgspec.Struct):
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


class EndSessionReply(Reply_):
    released: bool
    aborted_stores: int


class PinReply(Reply_):
    objects: int


class BlendStoreReply(Reply_):
    store_id: str | None
    slots: list[StoreSlot]
    chunk_size: int


class BlendLookupReply(Reply_):
    matches: list[Any]  # per matched chunk: where it sits in the prompt and which stored chunk it is
    candidate_chunks: int
    hit_tokens: int
    chunk_size: int


class ECLookupReply(Reply_):
    items: list[Any]
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


def reply_of(req: Request, result: Any) -> Reply_:
    """The typed reply of a request from a decoded result map; raises msgspec.ValidationError."""
    return msgspec.convert(result, REPLIES[req.op_name()])

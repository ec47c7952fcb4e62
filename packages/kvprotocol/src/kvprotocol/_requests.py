"""Every request of the control plane as one msgspec Struct: the one definition of its fields and bounds.

The same Structs decode a ZMQ msgpack header and an HTTP JSON body, so both doors accept exactly the
same things. A request map is `{"v", "id", "op", "auth"?, ...fields}`; `op` is the Struct's tag.
Simple bounds are msgspec `Meta` constraints; checks that span fields (or need a precise error code)
live in `__post_init__` and raise kvprotocol's `ValidationError`, which msgspec lets through as is.

To add an op: write its Struct here (a subclass of `Request` with `tag="name"`), add it to `REQUESTS`,
write its reply Struct in `_replies.py` and map it in `REPLIES`, then give the server a handler.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, ClassVar, Generic, Literal, TypeVar

import msgspec
from msgspec import Meta

from ._errors import ErrorCode, ValidationError
from ._hashing import check_extra
from ._keys import _FP_RE, _MODEL_RE, _SALT_RE, MAX_GROUPS, MAX_WORLD_SIZE
from ._keyspace import KeySpace
from ._layout import LayoutDescriptor

if TYPE_CHECKING:  # the reply types only parametrize the requests: _replies imports this module
    from . import _replies as rp

R = TypeVar("R", bound="rp.Reply_", covariant=True)  # the reply Struct a request is answered with

PROTOCOL_VERSION = 1
MAX_TOKENS = 1 << 20  # tokens in one request (4 MiB packed)
MAX_HEADER_BYTES = 4 * MAX_TOKENS + (64 << 10)  # the msgpack header: MAX_TOKENS plus the other fields
MAX_CHUNKS = 1 << 14
MAX_ID = (1 << 63) - 1
MAX_KEYS = 1 << 16  # objects one request may name (chunks x world_size x groups): bounds its work
MAX_CHECKSUMS = MAX_CHUNKS * MAX_GROUPS
U64_MAX = (1 << 64) - 1
MODES = ("shm", "tcp")

Model = Annotated[str, Meta(pattern=_MODEL_RE.pattern)]
Fingerprint = Annotated[str, Meta(pattern=_FP_RE.pattern)]
Salt = Annotated[str, Meta(pattern=_SALT_RE.pattern)]
WorldSize = Annotated[int, Meta(ge=1, le=MAX_WORLD_SIZE)]
Rank = Annotated[int, Meta(ge=0, le=MAX_WORLD_SIZE - 1)]
Chunk = Annotated[int, Meta(ge=0, le=MAX_CHUNKS)]
# A session id is a bearer name inside its tenant: at least 128 random bits' worth of length
# (22 url-safe base64 chars, e.g. kvprotocol.new_session_id()), so nobody can guess a live one.
SESSION_ID_RE = r"^[A-Za-z0-9_-]{22,128}$"
SessionId = Annotated[str, Meta(pattern=SESSION_ID_RE)]
StoreId = Annotated[str, Meta(min_length=1, max_length=64)]
Tokens = Annotated[bytes, Meta(max_length=4 * MAX_TOKENS)]  # packed uint32; over the bound: TOO_LARGE
Checksum = Annotated[int, Meta(ge=0)]  # and <= U64_MAX (Commit.__post_init__: Meta stops at int64)
Mode = Literal["shm", "tcp"]
ExtraPair = tuple[Annotated[int, Meta(ge=0, le=MAX_CHUNKS)], bytes]


class KeySpaceW(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Model, world size and one layout fingerprint per object group (kvprotocol.KeySpace on the wire)."""

    model: Model
    world_size: WorldSize
    groups: Annotated[list[Fingerprint], Meta(min_length=1, max_length=MAX_GROUPS)]

    def __post_init__(self) -> None:
        if self.world_size * len(self.groups) > MAX_KEYS:
            raise ValidationError(ErrorCode.TOO_LARGE, f"world_size x groups over {MAX_KEYS} objects per chunk")

    @property
    def per_chunk(self) -> int:
        return self.world_size * len(self.groups)

    def key(self) -> KeySpace:
        """The keyspace as the server keys objects by it (hashable: the groups as a tuple)."""
        return KeySpace(self.model, self.world_size, tuple(self.groups))


class LayoutW(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """A LayoutDescriptor on the wire; its value checks are the descriptor's own."""

    tag: str
    dtype: str
    num_layers: int
    block_size: int
    block_bytes: int
    chunk_size: int
    block_shape: list[int] = []
    stacked: bool = False
    variant: str = ""
    kind: str = "full"
    window: int = 0
    shared: bool = False
    scales: str = ""

    def __post_init__(self) -> None:
        self.descriptor()

    def descriptor(self) -> LayoutDescriptor:
        return LayoutDescriptor(
            self.tag,
            self.dtype,
            self.num_layers,
            self.block_size,
            self.block_bytes,
            self.chunk_size,
            tuple(self.block_shape),
            self.stacked,
            self.variant,
            self.kind,
            self.window,
            self.shared,
            self.scales,
        )


class Request(msgspec.Struct, Generic[R], tag_field="op", forbid_unknown_fields=True, kw_only=True):
    """The envelope every request carries; `op` is the tag, `R` the reply Struct it gets (what a
    typed `send` returns; kvprotocol._replies.REPLIES maps the same at run time).

    `v` and `id` are filled in by the client as it sends (0 = not set: the server refuses it), so a
    request is built from its own fields only.
    """

    v: int = 0
    id: Annotated[int, Meta(ge=0, le=MAX_ID)] = 0
    auth: Annotated[str, Meta(max_length=1024)] | None = None
    DATA_IN: ClassVar[bool] = False  # whether data frames may follow the header

    def op_name(self) -> str:
        return str(type(self).__struct_config__.tag)


def _check_tokens(tokens: bytes) -> None:
    if len(tokens) % 4:
        raise ValidationError(ErrorCode.BAD_FIELD, "tokens length must be a multiple of 4")


def _check_extra(extra: list[tuple[int, bytes]] | None) -> list[tuple[int, bytes]] | None:
    if extra is None:
        return None
    if len(extra) > MAX_CHUNKS:
        raise ValidationError(ErrorCode.BAD_FIELD, f"extra must be a list of at most {MAX_CHUNKS} pairs")
    try:
        return check_extra(extra)
    except ValueError as exc:
        raise ValidationError(ErrorCode.BAD_FIELD, str(exc)) from None


class Ping(Request["rp.PingReply"], tag="ping"):
    pass


class Describe(Request["rp.DescribeReply"], tag="describe"):
    pass


class Clear(Request["rp.ClearReply"], tag="clear"):
    pass


class RegisterEngine(Request["rp.RegisterReply"], tag="register_engine"):
    model: Model
    world_size: WorldSize
    rank: Rank
    groups: Annotated[list[LayoutW], Meta(min_length=1, max_length=MAX_GROUPS)]
    host: Annotated[str, Meta(min_length=1, max_length=255)] | None = None
    pid: Annotated[int, Meta(ge=0, le=1 << 31)] | None = None

    def layouts(self) -> list[LayoutDescriptor]:
        return [g.descriptor() for g in self.groups]


class KeysRequest(Request[R], kw_only=True):
    """A request naming the objects of a token sequence: keyspace, tokens, extra keys, cache salt."""

    keyspace: KeySpaceW
    tokens: Tokens
    extra: list[ExtraPair] | None = None
    salt: Salt = ""

    def __post_init__(self) -> None:
        _check_tokens(self.tokens)
        self.extra = _check_extra(self.extra)


class Lookup(KeysRequest["rp.LookupReply"], tag="lookup"):
    session: SessionId | None = None
    rank: Rank | None = None  # with session: lease only this rank's objects
    wait: bool = True  # False: never wait for an L2 prefetch; the reply says whether one is pending
    # with wait=False: while a prefetch runs, wait (bounded) until it has located its objects and
    # answer how far L1 + L2 will cover (`expected_tokens`), so a streamed load can start at once
    expect: bool = False
    # with expect: also wait (bounded) until the chunk the L1 hit stops at has landed or the prefetch
    # ended: a streamed load's poll, one round trip per step of progress instead of a busy loop
    progress: bool = False
    # where the full chunks stop, also find a stored tail (a partial last chunk, `Store.tail`) of these
    # tokens: the hit then ends inside a chunk (hit_tokens not a multiple of chunk_size, the tail one
    # more of hit_chunks). Only servers whose RegisterReply says `tails` take it
    tails: bool = False


class Query(KeysRequest["rp.QueryReply"], tag="query"):
    pass


MAX_ANNOUNCE_S = 5.0


class Announce(KeysRequest["rp.AnnounceReply"], tag="announce", kw_only=True):
    """An engine is computing the chunks from `start_chunk` on and will store them within `ttl_s`:
    until then (or until `session` stores them), another session's lookup that stops at one of them
    is answered `inflight` ("ask again later") instead of computing the same prefix twice. A hint:
    it holds no space, and the wait it causes is bounded by `ttl_s`."""

    session: SessionId
    start_chunk: Chunk = 0
    ttl_s: Annotated[float, Meta(gt=0, le=MAX_ANNOUNCE_S)]


class Pin(KeysRequest["rp.PinReply"], tag="pin"):
    pass


class Unpin(KeysRequest["rp.PinReply"], tag="unpin"):
    pass


class Store(KeysRequest["rp.StoreReply"], tag="store", kw_only=True):
    """With `reservation` (an id the producer picks, scoped to its tenant): the first store of it must
    declare `total_chunks`, and the server admits it only when all of them fit (docs/pd.md)."""

    rank: Rank
    start_chunk: Chunk = 0
    mode: Mode = "shm"
    session: SessionId | None = None
    reservation: SessionId | None = None
    total_chunks: Annotated[int, Meta(ge=1, le=MAX_CHUNKS)] | None = None
    # the tokens end inside a chunk: that partial last chunk is stored too, as one more object (a tail,
    # kvprotocol.tail_hash) that a lookup with `tails` finds. Not with extra keys or a reservation
    tail: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.total_chunks is not None and self.reservation is None:
            raise ValidationError(ErrorCode.BAD_FIELD, "store: total_chunks needs reservation")
        if self.tail and (self.reservation is not None or self.extra):
            raise ValidationError(ErrorCode.BAD_FIELD, "store: a tail takes no reservation and no extra keys")


class Commit(Request["rp.CommitReply"], tag="commit"):
    store_id: StoreId
    checksums: Annotated[list[Checksum], Meta(max_length=MAX_CHECKSUMS)]  # one kvsum64 per reserved slot
    DATA_IN: ClassVar[bool] = True  # tcp mode: one data frame per reserved slot

    def __post_init__(self) -> None:
        if any(c > U64_MAX for c in self.checksums):
            raise ValidationError(ErrorCode.OUT_OF_RANGE, "checksums must be unsigned 64-bit integers")


class Abort(Request["rp.AbortReply"], tag="abort"):
    store_id: StoreId


class Retrieve(Request["rp.RetrieveReply"], tag="retrieve"):
    session: SessionId
    rank: Rank
    start_chunk: Chunk
    end_chunk: Chunk
    mode: Mode = "shm"


class Release(Request["rp.ReleaseReply"], tag="release"):
    """Without rank: the whole session; with rank (+ the lease number from retrieve): that reader only.

    `corrupt` names the chunks whose objects this rank read but whose bytes failed their kvsum64: the
    server checks them itself before the leases end and drops what it finds damaged (a claim it
    cannot confirm changes nothing).
    """

    session: SessionId
    rank: Rank | None = None
    lease: Annotated[int, Meta(ge=1, le=MAX_ID)] | None = None
    corrupt: Annotated[list[Chunk], Meta(max_length=MAX_CHUNKS)] = []

    def __post_init__(self) -> None:
        if self.lease is not None and self.rank is None:
            raise ValidationError(ErrorCode.BAD_FIELD, "release: lease needs rank")
        if self.corrupt and self.rank is None:
            raise ValidationError(ErrorCode.BAD_FIELD, "release: corrupt needs rank")


class EndSession(Request["rp.EndSessionReply"], tag="end_session"):
    session: SessionId


# -- CacheBlend (docs/blend.md): chunks named by content, not by prefix; opt-in ---------------------
class BlendStore(KeysRequest["rp.BlendStoreReply"], tag="blend_store", kw_only=True):
    """One segment (document); its chunk i holds KV computed at pos_base + i * chunk_size."""

    rank: Rank
    pos_base: Annotated[int, Meta(ge=0, le=MAX_TOKENS)] = 0
    mode: Mode = "shm"
    session: SessionId | None = None


class BlendLookup(KeysRequest["rp.BlendLookupReply"], tag="blend_lookup", kw_only=True):
    """A whole prompt and where its segments start; matches are leased like a lookup's prefix."""

    starts: Annotated[list[Annotated[int, Meta(ge=0, le=MAX_TOKENS - 1)]], Meta(min_length=1, max_length=MAX_CHUNKS)]
    session: SessionId | None = None
    rank: Rank | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if any(b <= a for a, b in zip(self.starts, self.starts[1:])):
            raise ValidationError(ErrorCode.BAD_FIELD, "starts must be strictly increasing")


# -- encoder cache (docs/multimodal.md): one encoder output per multimodal item -------------------
MAX_EC_ITEMS = 256
MAX_EC_BYTES = 1 << 34
ECItem = Annotated[str, Meta(pattern=r"^[A-Za-z0-9._:@+=/-]{1,256}$")]
ECSize = Annotated[int, Meta(ge=0, le=MAX_EC_BYTES)]
ECLeaseId = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


def _u64(value: int, what: str) -> None:
    if value > U64_MAX:
        raise ValidationError(ErrorCode.OUT_OF_RANGE, f"{what} must be an unsigned 64-bit integer")


class ECLookup(Request["rp.ECLookupReply"], tag="ec_lookup", kw_only=True):
    model: Model
    space: Fingerprint
    items: Annotated[list[ECItem], Meta(min_length=1, max_length=MAX_EC_ITEMS)]
    readers: Annotated[int, Meta(ge=0, le=MAX_WORLD_SIZE)] | None = None  # > 0: lease each hit for that many


class ECStore(Request["rp.ECStoreReply"], tag="ec_store", kw_only=True):
    model: Model
    space: Fingerprint
    item: ECItem
    dtype: Annotated[str, Meta(pattern=r"^[a-z][a-z0-9_]{0,31}$")]
    shape: Annotated[list[ECSize], Meta(min_length=1, max_length=8)]
    size: ECSize
    mode: Mode = "shm"


class ECCommit(Request["rp.ECCommitReply"], tag="ec_commit", kw_only=True):
    store_id: StoreId
    checksum: Annotated[int, Meta(ge=0)]
    DATA_IN: ClassVar[bool] = True  # tcp mode: the object's bytes as one frame

    def __post_init__(self) -> None:
        _u64(self.checksum, "checksum")


class ECAbort(Request["rp.ECAbortReply"], tag="ec_abort", kw_only=True):
    store_id: StoreId


class ECRetrieve(Request["rp.ECRetrieveReply"], tag="ec_retrieve", kw_only=True):
    model: Model
    space: Fingerprint
    item: ECItem
    mode: Mode = "shm"


class ECRelease(Request["rp.ECReleaseReply"], tag="ec_release", kw_only=True):
    lease: ECLeaseId  # as ec_lookup / ec_retrieve handed it out: 128 random bits, owned by its tenant


class ECClear(Request["rp.ClearReply"], tag="ec_clear"):
    pass


REQUESTS: dict[str, type[Request]] = {
    cls.__struct_config__.tag: cls  # type: ignore[misc]
    for cls in (
        Ping,
        Describe,
        Clear,
        RegisterEngine,
        Lookup,
        Query,
        Announce,
        Store,
        Commit,
        Abort,
        Retrieve,
        Release,
        EndSession,
        Pin,
        Unpin,
        BlendStore,
        BlendLookup,
        ECLookup,
        ECStore,
        ECCommit,
        ECAbort,
        ECRetrieve,
        ECRelease,
        ECClear,
    )
}
AnyRequest = (
    Ping
    | Describe
    | Clear
    | RegisterEngine
    | Lookup
    | Query
    | Store
    | Commit
    | Abort
    | Retrieve
    | Release
    | EndSession
    | Pin
    | Unpin
    | BlendStore
    | BlendLookup
    | ECLookup
    | ECStore
    | ECCommit
    | ECAbort
    | ECRetrieve
    | ECRelease
    | ECClear
)


def fields_of(req: Request) -> dict[str, object]:
    """The op's own fields (no envelope) as builtins: what a log line or test inspects."""
    out = msgspec.structs.asdict(req)
    for name in ("v", "id", "auth"):
        out.pop(name, None)
    return out


Token = Annotated[int, Meta(ge=0, le=0xFFFFFFFF)]


class KeysBody(msgspec.Struct, forbid_unknown_fields=True):
    """The JSON body of the admin API's key endpoints (query, pin, unpin): tokens as a list of ids.

    `request()` turns it into the op's request Struct, so the values are checked by the one definition.
    """

    model: str
    world_size: int
    groups: list[str]
    tokens: Annotated[list[Token], Meta(max_length=MAX_TOKENS)]
    salt: str | None = None

    def request(self, cls: type[KeysRequest]) -> KeysRequest:
        from ._hashing import pack_tokens

        wire = {
            "keyspace": {"model": self.model, "world_size": self.world_size, "groups": self.groups},
            "tokens": pack_tokens(self.tokens),
            "salt": self.salt or "",
        }
        return msgspec.convert(wire, cls, strict=True)

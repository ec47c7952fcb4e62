"""Layout descriptors: what the bytes of one cached object mean, and the fingerprint that names it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, NotRequired, TypedDict

import msgpack
from blake3 import blake3

from ._errors import ErrorCode, ValidationError

LAYOUT_TAGS = ("vllm_cpu", "flash_attn", "mla", "vllm_hnd", "vllm_nhd", "state_page")
GROUP_KINDS = ("full", "sliding", "state")  # see kvprotocol._geometry
DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "uint8": 1, "int8": 1}
MAX_OBJECT_BYTES = 1 << 31
MAX_BLOCK_DIMS = 8  # a block's tensor shape; bounded so a registration cannot carry a huge list
_TAG_RE = re.compile(r"^[a-z0-9_]{1,32}$")
_SCALES_RE = re.compile(r"^[0-9a-f]{16}$")


class LayoutWire(TypedDict):
    """A LayoutDescriptor as an untyped request carries it (`to_wire`; the typed one is `LayoutW`)."""

    tag: str
    dtype: str
    num_layers: int
    block_size: int
    block_bytes: int
    chunk_size: int
    block_shape: list[int]
    stacked: bool
    variant: str
    kind: str
    window: int
    shared: bool
    scales: NotRequired[str]  # only when set


@dataclass(frozen=True, slots=True)
class LayoutDescriptor:
    """How one object group's KV is laid out in the engine, per rank.

    `block_bytes` is the size of one block of one layer (all its tokens, K and V, as the engine
    stores it). A chunk object holds `chunk_size // block_size` blocks of every layer, layer-major:
    [layer][block-in-chunk][block_bytes]. `stacked` says whether the engine keeps one tensor for all
    layers or one per layer; it changes the copy segments, not the object format.
    """

    tag: str
    dtype: str
    num_layers: int
    block_size: int
    block_bytes: int
    chunk_size: int
    block_shape: tuple[int, ...] = ()
    stacked: bool = False
    variant: str = ""  # what else decides the bytes, e.g. the CPU attention ISA that packs a block
    # Which objects of the group a prefix needs (kvprotocol._geometry): "full" attention (every chunk),
    # "sliding" (one snapshot of the blocks of the last `window` tokens before a chunk boundary),
    # "state" (a recurrent state after a chunk). The last two are usable only at exactly their
    # boundary. `shared`: every rank holds the same bytes (MLA's latent cache), so one object per
    # chunk serves all ranks.
    kind: str = "full"
    window: int = 0
    shared: bool = False
    # fp8 KV: a digest of every layer's (k_scale, v_scale). A byte means scale * value, so objects
    # written under one set of scales must never be read under another (kvconnector.layout_reader).
    scales: str = ""

    def __post_init__(self) -> None:
        _check(bool(_TAG_RE.match(self.tag)), f"bad layout tag {self.tag!r}")
        _check(self.variant == "" or bool(_TAG_RE.match(self.variant)), f"bad layout variant {self.variant!r}")
        _check(self.dtype in DTYPES, f"unknown dtype {self.dtype!r}")
        _check(1 <= self.num_layers <= 4096, "num_layers out of range")
        _check(1 <= self.block_size <= 65536, "block_size out of range")
        _check(1 <= self.block_bytes <= MAX_OBJECT_BYTES, "block_bytes out of range")
        _check(1 <= self.chunk_size <= 65536, "chunk_size out of range")
        _check(self.chunk_size % self.block_size == 0, "chunk_size must be a multiple of block_size")
        _check(
            len(self.block_shape) <= MAX_BLOCK_DIMS,
            f"block_shape has more than {MAX_BLOCK_DIMS} dims",
            ErrorCode.TOO_LARGE,
        )
        _check(
            all(isinstance(d, int) and not isinstance(d, bool) and 0 < d <= MAX_OBJECT_BYTES for d in self.block_shape),
            "bad block_shape",
        )
        _check(self.object_bytes <= MAX_OBJECT_BYTES, "object too large")
        _check(self.scales == "" or bool(_SCALES_RE.match(self.scales)), "bad layout scales digest")
        _check(self.kind in GROUP_KINDS, f"unknown group kind {self.kind!r}", ErrorCode.BAD_FIELD)
        _check(
            (self.kind == "sliding") == (self.window > 0) and 0 <= self.window <= 1 << 24,
            "window must be > 0 exactly for sliding groups (and at most 2^24 tokens)",
        )

    @property
    def blocks_per_chunk(self) -> int:
        """Blocks one object holds: a chunk's, or for a sliding group the blocks of one window."""
        if self.kind == "sliding":
            return -(-self.window // self.block_size)
        return self.chunk_size // self.block_size

    @property
    def object_bytes(self) -> int:
        """Bytes of one chunk object (one rank, one group)."""
        return self.num_layers * self.blocks_per_chunk * self.block_bytes

    @property
    def fingerprint(self) -> str:
        """16 hex chars naming what the bytes mean; any change of layout or dtype changes it."""
        parts: list[Any] = [
            self.tag,
            self.dtype,
            self.num_layers,
            self.block_size,
            self.block_bytes,
            self.chunk_size,
            list(self.block_shape),
            self.variant,
        ]
        if (self.kind, self.window, self.shared) != ("full", 0, False) or self.scales:  # others unchanged
            parts += [self.kind, self.window, self.shared]
        if self.scales:
            parts.append(self.scales)
        canon = msgpack.packb(parts)
        return blake3(b"kv-layout-v1" + canon).hexdigest()[:16]

    def to_wire(self) -> LayoutWire:
        d = LayoutWire(
            tag=self.tag,
            dtype=self.dtype,
            num_layers=self.num_layers,
            block_size=self.block_size,
            block_bytes=self.block_bytes,
            chunk_size=self.chunk_size,
            block_shape=list(self.block_shape),
            stacked=self.stacked,
            variant=self.variant,
            kind=self.kind,
            window=self.window,
            shared=self.shared,
        )
        if self.scales:  # servers that predate fp8 scales accept every layout without them
            d["scales"] = self.scales
        return d

    @classmethod
    def from_wire(cls, data: object) -> LayoutDescriptor:
        if not isinstance(data, dict):
            raise ValidationError(ErrorCode.BAD_FIELD, "layout must be a map")
        fields = {
            "tag": str,
            "dtype": str,
            "num_layers": int,
            "block_size": int,
            "block_bytes": int,
            "chunk_size": int,
            "block_shape": list,
            "stacked": bool,
            "variant": str,
            "kind": str,
            "window": int,
            "shared": bool,
            "scales": str,
        }
        required = {"tag", "dtype", "num_layers", "block_size", "block_bytes", "chunk_size"}
        extra = set(data) - set(fields)
        _check(not extra, f"unexpected layout fields {sorted(map(str, extra))}", ErrorCode.BAD_FIELD)
        missing = required - set(data)
        _check(not missing, f"missing layout fields {sorted(missing)}", ErrorCode.BAD_FIELD)
        for name, typ in fields.items():
            if name in data:
                value = data[name]
                ok = isinstance(value, typ) and not (typ is int and isinstance(value, bool))
                _check(ok, f"layout field {name} must be {typ.__name__}", ErrorCode.BAD_FIELD)
        _check(
            len(data.get("block_shape", ())) <= MAX_BLOCK_DIMS,
            f"block_shape has more than {MAX_BLOCK_DIMS} dims",
            ErrorCode.TOO_LARGE,
        )
        kwargs = dict(data)
        kwargs["block_shape"] = tuple(kwargs.get("block_shape", ()))
        return cls(**kwargs)


def _check(cond: bool, message: str, code: ErrorCode = ErrorCode.OUT_OF_RANGE) -> None:
    if not cond:
        raise ValidationError(code, message)

"""Request bodies of the coordinator API (pydantic, or msgspec for the per-request lookup, checks shape and
bounds; extra fields are errors)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta
from pydantic import BaseModel, ConfigDict, Field

from kvprotocol import MAX_TOKENS, PROTOCOL_VERSION, ErrorCode, ValidationError, unpack_tokens, validate_request

Model = Annotated[str, Field(min_length=1, max_length=200)]
LookupToken = Annotated[int, Meta(ge=0, le=0xFFFFFFFF)]
_STRICT = ConfigDict(extra="forbid", strict=True)


class Stats(BaseModel):
    """What a heartbeat may refresh."""

    model_config = _STRICT

    models: list[Model] | None = Field(default=None, max_length=64)
    l1_used_bytes: int | None = Field(default=None, ge=0)
    objects: int | None = Field(default=None, ge=0)
    kv_events_seq: int | None = Field(default=None, ge=0, description="Next KV-events sequence number.")


class KVEventsAd(BaseModel):
    """Where an instance publishes its KV events (docs/kv-events.md), for the prefix index."""

    model_config = _STRICT

    endpoint: str = Field(pattern=r"^(tcp|ipc)://[^\s]{1,250}$", description="The PUB socket.")
    replay_endpoint: str | None = Field(default=None, pattern=r"^(tcp|ipc)://[^\s]{1,250}$")
    topic: str = Field(
        min_length=7, max_length=300, description="The topic template with the host filled in, e.g. kv@node1@{model}."
    )


class Registration(Stats):
    zmq_url: str = Field(pattern=r"^(tcp|ipc)://[^\s]{1,250}$", description="Control-plane url of the server.")
    http_url: str | None = Field(
        default=None,
        pattern=r"^https?://[^\s/]{1,250}$",
        description="Admin API base url (needed for fleet status and lookup).",
    )
    version: str = Field(min_length=1, max_length=64)
    l1_capacity_bytes: int = Field(ge=0)
    chunk_size: int | None = Field(default=None, ge=1, le=65536)
    heartbeat_interval: float = Field(default=5.0, gt=0, le=3600)
    kv_events: KVEventsAd | None = Field(default=None, description="KV events of the instance, if it publishes.")

    def fields(self) -> dict[str, Any]:
        out = self.model_dump(exclude_none=False)
        out["kv_events"] = self.kv_events  # the model itself, not a dict
        return out


class LookupBody(msgspec.Struct, forbid_unknown_fields=True):
    """Same body as a kvserver's POST /v1/query, plus `mode`.

    A msgspec Struct, not a pydantic model: a router sends one per request, and msgspec decodes
    and bounds-checks 4096 tokens straight from the bytes in a fraction of pydantic's time.
    `tokens` may also be a base64 string of the ids packed as little-endian uint32 (the wire form
    of kvprotocol's `pack_tokens`): decoding and hashing that skips a list of 4096 ints, the
    largest cost left in a lookup.
    """

    model: str
    world_size: Annotated[int, Meta(ge=1)]
    groups: Annotated[list[str], Meta(min_length=1)]
    tokens: (
        Annotated[list[LookupToken], Meta(max_length=MAX_TOKENS)]
        | Annotated[
            bytes, Meta(max_length=4 * MAX_TOKENS, description="or base64 of the ids packed as little-endian uint32")
        ]
    )
    salt: str | None = None
    mode: Annotated[
        Literal["auto", "verify", "fanout"],
        Meta(
            description="auto: index where in sync, else ask; verify: ask the index's best few; "
            "fanout: ask every instance."
        ),
    ] = "auto"

    def check(self) -> None:
        """The values checks a server applies (kvprotocol's schema); raises kvprotocol ValidationError."""
        # the tokens' bounds (count, uint32 range) are the Struct's above: packing 4096 of them again
        # only to check them would cost more than answering the lookup from the index
        if isinstance(self.tokens, bytes) and len(self.tokens) % 4:
            raise ValidationError(ErrorCode.BAD_FIELD, "packed tokens must be a multiple of 4 bytes long")
        msg: dict[str, Any] = {
            "v": PROTOCOL_VERSION,
            "id": 0,
            "op": "query",
            "tokens": b"",
            "keyspace": {"model": self.model, "world_size": self.world_size, "groups": list(self.groups)},
        }
        if self.salt is not None:
            msg["salt"] = self.salt
        validate_request(msg)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // 4 if isinstance(self.tokens, bytes) else len(self.tokens)

    def query_body(self) -> dict[str, Any]:
        """The body of the instances' POST /v1/query (everything but `mode`; tokens as a list)."""
        tokens = list(unpack_tokens(self.tokens)) if isinstance(self.tokens, bytes) else self.tokens
        out: dict[str, Any] = {
            "model": self.model,
            "world_size": self.world_size,
            "groups": self.groups,
            "tokens": tokens,
        }
        if self.salt is not None:
            out["salt"] = self.salt
        return out

"""Request bodies of the coordinator API (pydantic checks shape and bounds; extra fields are errors)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvprotocol import MAX_TOKENS, PROTOCOL_VERSION, validate_request

Model = Annotated[str, Field(min_length=1, max_length=200)]
Token = Annotated[int, Field(ge=0, le=0xFFFFFFFF)]
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
    topic: str = Field(min_length=7, max_length=300,
                       description="The topic template with the host filled in, e.g. kv@node1@{model}.")


class Registration(Stats):
    zmq_url: str = Field(pattern=r"^(tcp|ipc)://[^\s]{1,250}$", description="Control-plane url of the server.")
    http_url: str | None = Field(default=None, pattern=r"^https?://[^\s/]{1,250}$",
                                 description="Admin API base url (needed for fleet status and lookup).")
    version: str = Field(min_length=1, max_length=64)
    l1_capacity_bytes: int = Field(ge=0)
    chunk_size: int | None = Field(default=None, ge=1, le=65536)
    heartbeat_interval: float = Field(default=5.0, gt=0, le=3600)
    kv_events: KVEventsAd | None = Field(default=None, description="KV events of the instance, if it publishes.")

    def fields(self) -> dict[str, Any]:
        out = self.model_dump(exclude_none=False)
        out["kv_events"] = self.kv_events  # the model itself, not a dict
        return out


class LookupBody(BaseModel):
    """Same body as a kvserver's POST /v1/query."""

    model_config = _STRICT

    model: str
    world_size: int = Field(ge=1)
    groups: list[str] = Field(min_length=1)
    tokens: list[Token] = Field(max_length=MAX_TOKENS)
    salt: str | None = None
    mode: Literal["auto", "verify", "fanout"] = Field(
        default="auto", description="auto: index where in sync, else ask; verify: ask the index's best few; "
                                    "fanout: ask every instance.")

    def check(self) -> None:
        """The values checks a server applies (kvprotocol's schema); raises kvprotocol ValidationError."""
        # the tokens' bounds (count, uint32 range) are pydantic's above: packing 4096 of them again
        # only to check them would cost more than answering the lookup from the index
        msg: dict[str, Any] = {"v": PROTOCOL_VERSION, "id": 0, "op": "query", "tokens": b"",
                               "keyspace": {"model": self.model, "world_size": self.world_size,
                                            "groups": list(self.groups)}}
        if self.salt is not None:
            msg["salt"] = self.salt
        validate_request(msg)

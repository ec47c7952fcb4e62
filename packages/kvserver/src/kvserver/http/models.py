"""Request bodies of the admin API, and their conversion into kvprotocol-validated op fields.

Pydantic checks the JSON shape; kvprotocol's closed schema then checks the values exactly as it does
for ZMQ requests, so both doors accept the same things.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from kvprotocol import MAX_TOKENS, PROTOCOL_VERSION, pack_tokens, validate_request

Token = Annotated[int, Field(ge=0, le=0xFFFFFFFF)]


class KeysBody(BaseModel):
    """Which objects: a keyspace (model, world size, one layout fingerprint per group) and tokens."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(description="Model name as the engines register it.")
    world_size: int = Field(ge=1, description="Tensor-parallel world size of the engines.")
    groups: list[str] = Field(min_length=1, description="Layout fingerprints, one per object group.")
    tokens: list[Token] = Field(max_length=MAX_TOKENS, description="Token ids of the prompt.")
    salt: str | None = Field(default=None, description="Cache salt (tenant isolation), if any.")

    def to_fields(self, op: str) -> dict[str, Any]:
        """Run the ZMQ schema's checks for `op` (query, pin, unpin); raises kvprotocol ValidationError."""
        msg: dict[str, Any] = {
            "v": PROTOCOL_VERSION, "id": 0, "op": op,
            "keyspace": {"model": self.model, "world_size": self.world_size, "groups": list(self.groups)},
            "tokens": pack_tokens(self.tokens),
        }
        if self.salt is not None:
            msg["salt"] = self.salt
        return validate_request(msg)[2]


class QueryBody(KeysBody):
    pass


class PinBody(KeysBody):
    pass

"""`GET /v1/kv-events/snapshot`: the blocks this server has announced, for a subscriber that resyncs.

A subscriber that missed sequence numbers (a gap, a late join, a restart it did not see) replaces
what it knew of this server with the snapshot and applies the stream from `next_seq` on. The
snapshot is taken after pending events are flushed, in the loop that publishes them, so it is the
state after every batch below `next_seq` and before every batch from it: re-applying a batch the
snapshot already reflects changes nothing (stores and removals are idempotent).

Hashes are the low 64 bits of the chunk hashes (vLLM's int block-hash form, whatever
`--kv-events-hash-format` says), packed little-endian uint64 and base64-encoded: 8 bytes a chunk.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
from fastapi import APIRouter

from .backend import AdminBackend
from .errors import ApiError


def snapshot(server: AdminBackend) -> dict[str, Any]:
    snap = server.kv_events_snapshot()
    if snap is None:
        raise ApiError(404, "NOT_FOUND", "KV events are off (start with --kv-events-endpoint)")
    models = {}
    for model, hashes in snap.models.items():
        low = np.frombuffer(b"".join(h[-8:] for h in hashes), dtype=">u8").astype("<u8")
        models[model] = base64.b64encode(low.tobytes()).decode()
    return {"next_seq": snap.next_seq, "medium": snap.medium, "chunk_size": server.config.chunk_size, "models": models}


def router(server: AdminBackend, read: list[Any]) -> APIRouter:
    api = APIRouter()

    @api.get("/v1/kv-events/snapshot", tags=["kv-events"], dependencies=read)
    async def kv_events_snapshot() -> dict[str, Any]:
        """The L1 blocks announced and not removed, and the sequence number the stream goes on from."""
        return snapshot(server)

    return api

"""The engine's side of the server's content index: store document chunks, find and load them anywhere.

Talks to a real kvserver over the control plane in tcp mode (object bytes ride as ZMQ frames): blend
chunks are whole-chunk K/V tensors of a torch model, not blocks of an engine's paged KV, so the
paged copy path of EngineClient does not apply. Like EngineClient it never raises into the engine:
any failure (server down, a checksum that does not match, a malformed reply) is a miss, counted in
`errors`, and the engine computes those tokens instead.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from kvprotocol import Client, KeySpace, flows, new_session_id, pack_tokens
from kvprotocol import replies as rp
from kvprotocol import requests as rq
from kvprotocol.kvsum import kvsum64

from .codec import ChunkCodec

log = logging.getLogger("kvconnector.blend")


@dataclass(frozen=True, slots=True)
class BlendMatch:
    """A cached chunk found in a prompt: tokens [start, start + chunk_size), KV computed at ref_pos."""

    start: int
    ref_pos: int


@dataclass
class LoadedChunk:
    start: int
    ref_pos: int
    k: list[torch.Tensor]  # per layer (kv_heads, chunk_size, head_dim), RoPE'd for ref_pos
    v: list[torch.Tensor]


@dataclass
class BlendStoreStats:
    stored_chunks: int = 0
    lookups: int = 0
    hit_chunks: int = 0
    errors: dict[str, int] = field(default_factory=dict)


class BlendStore:
    """One model's blend chunks on one kvserver (rank 0 of world 1: a single-process torch model)."""

    def __init__(
        self,
        url: str,
        model: str,
        codec: ChunkCodec,
        *,
        salt: str = "",
        timeout: float = 10.0,
        token: str | None = None,
    ) -> None:
        self.codec = codec
        self.salt = salt
        self.model = model
        self.keyspace = KeySpace.from_layouts(model, 1, [codec.layout])
        self.stats = BlendStoreStats()
        self._client = Client(url, timeout=timeout, token=token)
        self._registered = False

    def _ensure(self) -> None:
        if not self._registered:
            reply = self._client.register_engine(
                model=self.model, world_size=1, rank=0, groups=[rq.LayoutW(**self.codec.layout.to_wire())]
            )
            if reply.chunk_size != self.codec.chunk_size:
                raise ValueError(f"server chunk_size {reply.chunk_size} != codec {self.codec.chunk_size}")
            self._registered = True

    def _error(self, op: str, exc: BaseException) -> None:
        kind = f"{op}:{type(exc).__name__}"
        self.stats.errors[kind] = self.stats.errors.get(kind, 0) + 1
        log.warning("blend %s failed (a miss): %s", op, exc)

    def store_document(
        self,
        tokens: Sequence[int] | np.ndarray,
        k: Sequence[torch.Tensor],
        v: Sequence[torch.Tensor],
        pos_base: int = 0,
    ) -> int:
        """Store every full chunk of one document whose per-layer K/V (kv_heads, T, head_dim) were
        computed at positions pos_base.. (usually the document alone, from 0). Returns the chunks now
        cached (written here or already present); 0 on failure."""
        c = self.codec.chunk_size
        try:
            self._ensure()
            req = rq.BlendStore(
                keyspace=self.keyspace.wire(),
                tokens=pack_tokens(tokens),
                rank=0,
                salt=self.salt,
                pos_base=pos_base,
                mode="tcp",
            )

            def fill(_reply: object, reserved: list[rp.StoreSlot]) -> tuple[list[bytes], list[int]]:
                frames = []
                for slot in reserved:
                    s = slot.chunk * c
                    frames.append(self.codec.encode([kl[:, s : s + c] for kl in k], [vl[:, s : s + c] for vl in v]))
                return frames, [kvsum64(f) for f in frames]

            reply = flows.store_and_commit(self._client.send, req, fill)
            cached = sum(1 for s in reply.slots if s.status in ("reserved", "present"))
            self.stats.stored_chunks += cached
            return cached
        except Exception as exc:
            self._error("store", exc)
            return 0

    def lookup(self, tokens: Sequence[int] | np.ndarray, starts: Sequence[int]) -> list[BlendMatch]:
        """Which chunks of the prompt's segments are cached (no lease); [] on any failure."""
        try:
            self._ensure()
            result = self._client.blend_lookup(
                keyspace=self.keyspace.wire(),
                tokens=pack_tokens(tokens),
                starts=[int(s) for s in starts],
                salt=self.salt,
            )
            return [BlendMatch(m.start, m.ref_pos) for m in result.matches]
        except Exception as exc:
            self._error("lookup", exc)
            return []

    def load(self, tokens: Sequence[int] | np.ndarray, starts: Sequence[int]) -> list[LoadedChunk]:
        """Find, lease, copy and verify the prompt's cached chunks; [] (recompute all) on any failure."""
        session = new_session_id()
        self.stats.lookups += 1
        try:
            self._ensure()
            result = self._client.blend_lookup(
                keyspace=self.keyspace.wire(),
                tokens=pack_tokens(tokens),
                starts=[int(s) for s in starts],
                salt=self.salt,
                session=session,
            )
            matches = result.matches
            if not matches:
                return []

            def copy(reply: rp.RetrieveReply, frames: list[memoryview]) -> list[LoadedChunk]:
                if len(reply.objects) != len(matches) or len(frames) != len(matches):
                    raise ValueError("retrieve returned a different number of objects than matched")
                out = []
                for m, obj, frame in zip(matches, reply.objects, frames, strict=True):
                    if kvsum64(frame) != obj.checksum:  # the release reports it: the server checks and drops it
                        raise flows.CorruptCopy(f"checksum mismatch for the chunk at {m.start}", [obj.chunk])
                    k, v = self.codec.decode(frame)
                    out.append(LoadedChunk(m.start, m.ref_pos, k, v))
                return out

            # the release names the lease and must come back intact (flows.read_leased, prove=True)
            out = flows.read_leased(
                self._client.send,
                rq.Retrieve(session=session, rank=0, start_chunk=0, end_chunk=len(matches), mode="tcp"),
                copy,
                prove=True,
            )
            self.stats.hit_chunks += len(out)
            return out
        except Exception as exc:
            self._error("load", exc)
            try:
                self._client.end_session(session=session)
            except Exception:
                pass
            return []

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> BlendStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""vLLM's KV-events wire format (vllm/distributed/kv_events.py, vLLM 0.32), re-implemented with msgpack.

kvserver must not import vLLM (nor torch), so the structs are written out here, byte for byte what
vLLM's `msgspec.msgpack.Encoder` produces for them:

- a batch is `KVEventBatch` (msgspec `array_like`, `omit_defaults`): `[ts, events, data_parallel_rank]`;
  vLLM's `ZmqEventPublisher` always fills the rank (0 without data parallelism), so we send 0 too;
- an event is a *tagged map* (`tag=True`, not array_like): `{"type": "<ClassName>", field: value, ...}`
  in field-declaration order; fields without a default are always present (None included), fields
  with a default are left out while they hold it;
- `BlockStored`: block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name
  (then extra_keys, group_idx, ... which we never set); `BlockRemoved`: block_hashes, medium;
  `AllBlocksCleared`: no fields;
- a block hash (`ExternalBlockHash`) is `bytes` by default, or, as with vLLM's
  `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`, the low 64 bits of its big-endian value as an int.

tests/kvserver/kvevents checks these bytes against vLLM's own encoder and decoder.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

MEDIUM_L1 = "kvserver_l1"  # our shared-memory L1 (vLLM's own tiers are "GPU", "CPU", "STORAGE")
HASH_FORMATS = ("bytes", "int")
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay socket's end-of-replay marker

ExternalHash = bytes | int
Event = dict[str, Any]


def external_hash(chunk_hash: bytes, fmt: str) -> ExternalHash:
    """Our 32-byte chunk hash as a block hash: itself, or vLLM's 64-bit int form."""
    if fmt == "int":
        return int.from_bytes(chunk_hash, "big") & ((1 << 64) - 1)
    return chunk_hash


def block_stored(
    block_hashes: list[ExternalHash],
    parent: ExternalHash | None,
    token_ids: list[int] | np.ndarray,
    block_size: int,
    medium: str,
    lora_id: int | None = None,
    lora_name: str | None = None,
) -> Event:
    return {
        "type": "BlockStored",
        "block_hashes": block_hashes,
        "parent_block_hash": parent,
        "token_ids": token_ids,
        "block_size": block_size,
        "lora_id": lora_id,
        "medium": medium,
        "lora_name": lora_name,
    }


def block_removed(block_hashes: list[ExternalHash], medium: str) -> Event:
    return {"type": "BlockRemoved", "block_hashes": block_hashes, "medium": medium}


def all_blocks_cleared() -> Event:
    return {"type": "AllBlocksCleared"}


def encode_batch(ts: float, events: list[Event], data_parallel_rank: int = 0) -> bytes:
    """One `KVEventBatch` payload (floats as float64 and bytes as bin, as msgspec writes them).

    Token ids may be given as a uint32 numpy array: they are packed vectorised, which is what makes
    announcing a long prompt cheap on the server loop (a 4096-token list costs ~0.25 ms as Python ints).
    """
    parts = [b"\x93", msgpack.packb(float(ts)), _header(len(events), 0x90, 0xDC)]
    for event in events:
        parts.append(_header(len(event), 0x80, 0xDE))
        for key, value in event.items():
            parts.append(msgpack.packb(key))
            parts.append(
                pack_uint_array(value) if isinstance(value, np.ndarray) else msgpack.packb(value, use_bin_type=True)
            )
    parts.append(msgpack.packb(data_parallel_rank))
    return b"".join(parts)


def _header(n: int, fix: int, wide: int) -> bytes:
    """msgpack array (0x90/0xdc) or map (0x80/0xde) header for n items."""
    if n < 16:
        return bytes([fix | n])
    if n < 1 << 16:
        return bytes([wide]) + n.to_bytes(2, "big")
    return bytes([wide + 1]) + n.to_bytes(4, "big")


def pack_uint_array(values: np.ndarray) -> bytes:
    """A msgpack array of unsigned ints, each in its shortest form, exactly as msgpack/msgspec write them.

    Every value is laid out as tag + 4 big-endian bytes, then a per-width mask keeps the bytes its
    shortest form has (fixint: the last byte; uint8: tag + last; uint16: tag + last two; uint32: all).
    """
    v = np.ascontiguousarray(values, dtype=np.uint32)
    cls = np.searchsorted(_WIDTH_BOUNDS, v, side="right")
    full = np.empty((len(v), 5), dtype=np.uint8)
    full[:, 0] = np.take(_TAGS, cls)
    full[:, 1:] = v.astype(">u4").view(np.uint8).reshape(-1, 4)
    keep = np.take(_KEEP, cls, axis=0)  # np.take: several times faster than fancy indexing here
    return _header(len(v), 0x90, 0xDC) + full[keep].tobytes()


_WIDTH_BOUNDS = np.array([0x80, 0x100, 0x10000], dtype=np.uint32)
_TAGS = np.array([0, 0xCC, 0xCD, 0xCE], dtype=np.uint8)
_KEEP = np.array([[0, 0, 0, 0, 1], [1, 0, 0, 0, 1], [1, 0, 0, 1, 1], [1, 1, 1, 1, 1]], dtype=bool)


def decode_batch(payload: bytes) -> tuple[float, list[Event], int | None]:
    """The inverse of encode_batch, for tests and example subscribers (no vLLM needed)."""
    batch = msgpack.unpackb(payload, raw=False)
    return batch[0], batch[1], batch[2] if len(batch) > 2 else None

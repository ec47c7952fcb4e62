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


def block_stored(block_hashes: list[ExternalHash], parent: ExternalHash | None, token_ids: list[int],
                 block_size: int, medium: str, lora_id: int | None = None, lora_name: str | None = None) -> Event:
    return {"type": "BlockStored", "block_hashes": block_hashes, "parent_block_hash": parent,
            "token_ids": token_ids, "block_size": block_size, "lora_id": lora_id, "medium": medium,
            "lora_name": lora_name}


def block_removed(block_hashes: list[ExternalHash], medium: str) -> Event:
    return {"type": "BlockRemoved", "block_hashes": block_hashes, "medium": medium}


def all_blocks_cleared() -> Event:
    return {"type": "AllBlocksCleared"}


def encode_batch(ts: float, events: list[Event], data_parallel_rank: int = 0) -> bytes:
    """One `KVEventBatch` payload (floats as float64 and bytes as bin, as msgspec writes them)."""
    return msgpack.packb([float(ts), events, data_parallel_rank], use_bin_type=True)


def decode_batch(payload: bytes) -> tuple[float, list[Event], int | None]:
    """The inverse of encode_batch, for tests and example subscribers (no vLLM needed)."""
    batch = msgpack.unpackb(payload, raw=False)
    return batch[0], batch[1], batch[2] if len(batch) > 2 else None

"""Run by .venv-vllm's interpreter: decode our payloads with vLLM's own KV-event classes.

argv[1]: a msgpack file holding a list of payloads. Each must decode with
`msgspec.msgpack.Decoder(KVEventBatch)` and re-encode with vLLM's encoder to the very same bytes.
Prints a JSON summary of what vLLM decoded.
"""

import json
import sys

import msgpack
import msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher


def _hash(h):
    return h.hex() if isinstance(h, bytes) else h


def main() -> None:
    with open(sys.argv[1], "rb") as fh:
        payloads = msgpack.unpackb(fh.read())
    decoder, encoder = msgspec.msgpack.Decoder(KVEventBatch), msgspec.msgpack.Encoder()
    out = []
    for payload in payloads:
        batch = decoder.decode(payload)
        assert encoder.encode(batch) == payload, "vLLM re-encodes our batch to different bytes"
        events = []
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                events.append(
                    {
                        "type": "BlockStored",
                        "hashes": [_hash(h) for h in ev.block_hashes],
                        "parent": _hash(ev.parent_block_hash) if ev.parent_block_hash is not None else None,
                        "tokens": len(ev.token_ids),
                        "block_size": ev.block_size,
                        "medium": ev.medium,
                        "lora_id": ev.lora_id,
                        "lora_name": ev.lora_name,
                    }
                )
            elif isinstance(ev, BlockRemoved):
                events.append(
                    {"type": "BlockRemoved", "hashes": [_hash(h) for h in ev.block_hashes], "medium": ev.medium}
                )
            else:
                assert isinstance(ev, AllBlocksCleared)
                events.append({"type": "AllBlocksCleared"})
        out.append({"ts": batch.ts, "dp_rank": batch.data_parallel_rank, "events": events})
    print(json.dumps({"batches": out, "end_seq": ZmqEventPublisher.END_SEQ.hex()}))


if __name__ == "__main__":
    main()

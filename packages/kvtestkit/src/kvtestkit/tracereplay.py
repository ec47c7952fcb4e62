"""A trace's requests against a real kvserver: the step the capacity tests and benches share.

Each request looks its prefix up and stores the chunks it missed (zero bytes: only presence counts),
as an engine would after computing them. The simulators (tracesim.py, tiersim.py) predict the same
hit rates from the server's own policy classes; these replays check them against the real thing.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvprotocol import Client, KeySpace, LayoutDescriptor, flows, pack_tokens
from kvprotocol import requests as rq
from kvprotocol.kvsum import kvsum64

from .tracesim import BLOCK_TOKENS, OBJECT_BYTES

__all__ = ["TRACE_LAYOUT", "block_tokens", "register_trace", "replay_request"]

TRACE_LAYOUT = LayoutDescriptor("trace", "uint8", 1, 32, 256, BLOCK_TOKENS, (256,))  # one object per block
assert TRACE_LAYOUT.object_bytes == OBJECT_BYTES
_ZERO = bytes(OBJECT_BYTES)
_ZERO_SUM = kvsum64(_ZERO)


def block_tokens(hash_id: int) -> list[int]:
    """BLOCK_TOKENS synthetic token ids for one hash id: equal ids give equal tokens, distinct ids differ."""
    return [(hash_id * BLOCK_TOKENS + t) % (1 << 32) for t in range(BLOCK_TOKENS)]


def register_trace(c: Client) -> rq.KeySpaceW:
    """Register the trace's layout; the keyspace every replayed request uses."""
    c.register_engine(model="trace", world_size=1, rank=0, groups=[rq.LayoutW(**TRACE_LAYOUT.to_wire())])
    return KeySpace.from_layouts("trace", 1, [TRACE_LAYOUT]).wire()


def replay_request(c: Client, keyspace: rq.KeySpaceW, blocks: Sequence[int]) -> int:
    """Look up one request's blocks and store those past the hit; the chunks that hit."""
    toks = pack_tokens([t for b in blocks for t in block_tokens(b)])
    hit = c.lookup(keyspace=keyspace, tokens=toks).hit_chunks
    if hit < len(blocks):
        store = rq.Store(keyspace=keyspace, tokens=toks, rank=0, mode="tcp", start_chunk=hit)
        flows.store_and_commit(c.send, store, lambda _r, slots: ([_ZERO] * len(slots), [_ZERO_SUM] * len(slots)))
    return hit

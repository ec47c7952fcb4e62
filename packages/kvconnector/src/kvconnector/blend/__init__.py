"""CacheBlend on the engine side: reuse cached document chunks at any position, then recompute a few tokens.

Opt-in and approximate by design (docs/blend.md): the exact prefix path (EngineClient.lookup/load)
never goes through here. Pieces, one job each:

* `rope`: re-apply rotary position embedding to K computed at another position (V carries none).
* `codec`: per-layer K/V of one chunk <-> the bytes of one cache object.
* `store`: blend_store / blend_lookup / retrieve against a kvserver, errors become misses.
* `blender`: the selective-recompute prefill over a Llama-style torch model.
"""

from .blender import BlendOutcome, ReusedChunk, blend_prefill, full_prefill
from .codec import ChunkCodec
from .rope import rerope
from .store import BlendMatch, BlendStore

__all__ = [
    "BlendMatch",
    "BlendOutcome",
    "BlendStore",
    "ChunkCodec",
    "ReusedChunk",
    "blend_prefill",
    "full_prefill",
    "rerope",
]

"""Content fingerprints for CacheBlend chunks: keys that do not depend on what comes before a document.

Why a second hash family: a prefix key (`chunk_hashes`) names KV that is only valid after exactly
that prefix, so a document that moves in a RAG prompt never hits. A blend chunk is named by its
document's own tokens only: `f_{-1}` = BLAKE3("kvblend-v1"); `f_i = BLAKE3(f_{i-1} || tokens of chunk
i of the segment, big-endian uint32)`, restarting at every segment (document) start. The seed
differs from the prefix chain's zero hash, so the two families never collide.

The object key adds the reference position the bytes were computed at (`object_hash`): KV computed
at different positions is different bytes, and the engine re-applies RoPE from that position.
"""

from __future__ import annotations

from blake3 import blake3

from ._hashing import Tokens, big_endian_tokens, token_count

BLEND_SEED = blake3(b"kvblend-v1").digest()


def blend_fingerprints(tokens: Tokens, chunk_size: int) -> list[bytes]:
    """Fingerprints of every full chunk of one segment, from its first token (the tail is not hashed)."""
    if chunk_size <= 0:
        raise ValueError("chunk_size must be positive")
    n_full = token_count(tokens) // chunk_size
    big_endian = big_endian_tokens(tokens, n_full * chunk_size)
    step = chunk_size * 4
    out: list[bytes] = []
    prev = BLEND_SEED
    for i in range(n_full):
        prev = blake3(prev + big_endian[i * step : (i + 1) * step]).digest()
        out.append(prev)
    return out


def blend_object_hash(fingerprint: bytes, ref_pos: int) -> bytes:
    """The chunk-hash field of a blend object's key: its fingerprint plus the position base of its KV."""
    if not 0 <= ref_pos <= 0xFFFFFFFF:
        raise ValueError("ref_pos must fit in uint32")
    return blake3(b"kvblend-obj" + fingerprint + ref_pos.to_bytes(4, "big")).digest()

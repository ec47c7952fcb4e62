"""Chunk hashes the server computed lately, so the same tokens are not hashed again.

Why: the server hashes every request's tokens itself (a client's word on a key is never taken), and
the same tokens come back within seconds: a request's save after its lookup, every tensor-parallel
rank's save of the same prompt, a lookup asked again while L2 loads, the next turn of a conversation
(its whole history is the prefix). BLAKE3 over one 256-token chunk costs 2-3 us in Python; looking
the chunk up here costs under 1 us. A 4096-token lookup spent 36-56 us of its ~100 us hashing.

An entry is keyed by everything its hash depends on: the chain's previous hash, the chunk's token
bytes (as on the wire), the chunk's extra digest, and the request's scope, the tenant's key-space
salt. The scope keeps one tenant's (or cache_salt's) recent prompts from making another's hashing
measurably faster: no timing side channel across the boundaries L1 itself keeps. Least recently
used entries go first once the token bytes held pass `max_bytes`.
"""

from __future__ import annotations

from collections import OrderedDict

from kvprotocol import chunk_hashes
from kvprotocol._hashing import ZERO_HASH, ExtraKeys, check_extra

DEFAULT_MAX_BYTES = 32 << 20  # token bytes remembered: 32 MiB = 8M tokens, 32k chunks of 256
ENTRY_OVERHEAD = 200  # bytes an entry costs besides its chunk's tokens (key tuple, hash, dict slot)

Key = tuple[str, bytes, bytes, bytes]  # (scope, previous hash, chunk's token bytes, extra digest or b"")


class HashMemo:
    """`hashes()` is `kvprotocol.chunk_hashes` of wire-form tokens, remembered per scope."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0  # chunks answered from the memo
        self.misses = 0  # chunks hashed
        self._memo: OrderedDict[Key, bytes] = OrderedDict()

    def __len__(self) -> int:
        return len(self._memo)

    def describe(self) -> dict[str, int]:
        return {
            "chunks": len(self._memo),
            "bytes": self.bytes,
            "max_bytes": self.max_bytes,
            "hits": self.hits,
            "misses": self.misses,
        }

    def hashes(self, scope: str, tokens: bytes, chunk_size: int, extra: ExtraKeys = ()) -> list[bytes]:
        """Every full chunk's hash: the remembered head of the chain, then the rest computed (and
        remembered). Raises what chunk_hashes raises (IndexError: an extra key past the last chunk)."""
        step = 4 * chunk_size
        n_full = len(tokens) // step
        extras = dict(check_extra(extra, n_full)) if extra else {}
        memo, out, prev = self._memo, [], ZERO_HASH
        for i in range(n_full):
            key = (scope, prev, tokens[i * step : (i + 1) * step], extras.get(i, b""))
            h = memo.get(key)
            if h is None:
                break
            memo.move_to_end(key)
            out.append(h)
            prev = h
        start = len(out)
        self.hits += start
        if start == n_full:
            return out
        rest = chunk_hashes(tokens, chunk_size, extra, start=start, prev=prev)
        self.misses += len(rest)
        for i, h in enumerate(rest, start):
            key = (scope, prev, tokens[i * step : (i + 1) * step], extras.get(i, b""))
            if key in memo:  # a later link outlived an evicted earlier one
                memo.move_to_end(key)
            else:
                memo[key] = h
                self.bytes += step + ENTRY_OVERHEAD
            prev = h
        while self.bytes > self.max_bytes and memo:
            (_, _, chunk, _), _ = memo.popitem(last=False)
            self.bytes -= len(chunk) + ENTRY_OVERHEAD
        return out + rest

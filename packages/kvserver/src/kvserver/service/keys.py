"""The key planner: a request's chunk hashes, each chunk's object keys, and how much of a prefix is in L1.

Why its own module: every op (reads.py, writes.py, CacheBlend's lookup) names objects the same way,
and the prefix walk is the hot path of every lookup, kept here as plain loops over locals.
May import: the service's own modules, `l1`, `security`, `errors`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvprotocol import MAX_KEYS, ZERO_HASH, KeySpace, ObjectKey, tail_hash
from kvprotocol._requests import KeysRequest

from ..errors import BadField, OutOfRange, TooLarge
from ..l1.cache import State
from .leases import rank_keys
from ..security.tenants import Identity

if TYPE_CHECKING:
    from .state import CacheState


class KeyPlanner:
    """Chunk hashes (through the hash memo), object keys per chunk, the prefix hit in L1."""

    def __init__(self, state: CacheState) -> None:
        self.l1, self.groups, self.hash_memo = state.l1, state.groups, state.hash_memo
        self.chunk_size = state.chunk_size
        self.tails = state.tails

    @staticmethod
    def keyspace(keyspace: dict[str, Any]) -> KeySpace:
        """A keyspace map (field-map handlers, e.g. blend_index.py) as the server's key tuple."""
        return KeySpace(keyspace["model"], keyspace["world_size"], tuple(keyspace["groups"]))

    @staticmethod
    def per_chunk(f: KeysRequest) -> int:
        """Objects per chunk the request names (ranks x groups), what MAX_KEYS counts."""
        return f.keyspace.per_chunk

    def chunk_keys(self, ks: KeySpace, salt: str, chunk_hash: bytes, c: int = -1) -> list[ObjectKey]:
        """Every (rank, group) object of one chunk (with a geometry: every object ending at unit c)."""
        plan = self.groups.plan(ks)
        if plan is not None:
            return plan.ending_at(salt, chunk_hash, c)
        model, world, groups = ks
        return [
            tuple.__new__(ObjectKey, (model, fp, world, rank, g, salt, chunk_hash))  # hot: see ObjectKey
            for rank in range(world)
            for g, fp in enumerate(groups)
        ]

    def prefix_hits(
        self, ks: KeySpace, salt: str, hashes: list[bytes], hit_keys: list[list[ObjectKey]] | None = None
    ) -> int:
        """Largest k such that every (group, rank) object of chunks 0..k-1 is ready in L1.

        With `hit_keys` (a keyspace without a geometry), the keys of chunks 0..k-1 are appended to it,
        one list per chunk, so a lookup touches them without building them again.
        """
        plan = self.groups.plan(ks)
        if plan is not None:
            return plan.hit(salt, hashes, self.l1.ready)
        # the hot path of every lookup: plain loops over locals, no generators; l1.ready inlined
        entries, ready, new = self.l1.entries.get, State.READY, tuple.__new__
        model, world, groups = ks
        parts = [(model, fp, world, rank, g, salt) for rank in range(world) for g, fp in enumerate(groups)]
        for i, h in enumerate(hashes):
            keys = [new(ObjectKey, (*p, h)) for p in parts]  # see ObjectKey: built in C
            for key in keys:
                e = entries(key)
                if e is None or e.state is not ready:
                    return i
            if hit_keys is not None:
                hit_keys.append(keys)
        return len(hashes)

    def hashes(self, f: KeysRequest, per_chunk: int, who: Identity) -> list[bytes]:
        """The request's chunk hashes, its per-chunk extra keys folded in (kvprotocol's one definition,
        remembered per key-space salt: hash_memo.py).

        Runs before a handler changes anything: a request naming more than MAX_KEYS objects is
        TOO_LARGE before any hashing, and an extra key beyond the last full chunk is OUT_OF_RANGE.
        """
        chunks = len(f.tokens) // 4 // self.chunk_size
        if chunks * per_chunk > MAX_KEYS:
            raise TooLarge(f"{chunks} chunks x {per_chunk} objects each is over {MAX_KEYS} objects per request")
        try:
            return self.hash_memo.hashes(who.salt(f.salt), f.tokens, self.chunk_size, f.extra or ())
        except IndexError as exc:
            raise OutOfRange(str(exc)) from None

    def store_tail(self, f: KeysRequest, ks: KeySpace, salt: str, hashes: list[bytes], rank: int, start: int) -> bool:
        """A store's tail (Store.tail): its hash appended to `hashes` as one more chunk, its length
        remembered after the chunk before it (tails.py). False when the tokens end on a chunk boundary,
        or when the tail is stored alone and the chunk before it is not in L1 (this rank's objects):
        a tail no lookup can reach would only take room. A key space with a per-group geometry has no
        tails (a snapshot or a state lives at a boundary)."""
        n = len(f.tokens) // 4
        length = n % self.chunk_size
        if not length:
            return False
        if self.groups.plan(ks) is not None:
            raise BadField("store: a key space with sliding-window or state groups stores no tails")
        if hashes and start >= len(hashes):
            ready = self.l1.ready
            if any(ready(key) is None for key in rank_keys(ks, salt, rank, hashes[-1:])):
                return False
        parent = hashes[-1] if hashes else ZERO_HASH
        hashes.append(tail_hash(memoryview(f.tokens)[4 * (n - length) :], parent))
        self.tails.add((ks, salt, parent), length)
        return True

    def find_tail(
        self, f: KeysRequest, ks: KeySpace, salt: str, hashes: list[bytes], hit: int
    ) -> tuple[int, bytes, list[ObjectKey]] | None:
        """(length, hash, keys) of the longest remembered tail after chunk `hit` - 1 whose tokens start
        f's tokens there and whose every object is ready in L1; None without one."""
        if f.extra or self.groups.plan(ks) is not None:
            return None
        parent = hashes[hit - 1] if hit else ZERO_HASH
        lengths = self.tails.lengths((ks, salt, parent))
        if not lengths:
            return None
        c, n = self.chunk_size, len(f.tokens) // 4
        ready = self.l1.ready
        for length in sorted(lengths, reverse=True):
            if hit * c + length > n:
                continue
            h = tail_hash(memoryview(f.tokens)[4 * hit * c : 4 * (hit * c + length)], parent)
            keys = self.chunk_keys(ks, salt, h)
            if all(ready(k) is not None for k in keys):
                return length, h, keys
        return None


__all__ = ["KeyPlanner"]

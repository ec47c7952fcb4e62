"""The fleet prefix index: which instance holds which chunk, fed by the instances' KV events.

A fleet lookup walks a prompt's chunk keys through one dict instead of asking every instance, so
its cost does not grow with the fleet. Compact on purpose (10 M chunks must fit):

- a chunk key is one 64-bit int: the low 64 bits of the chunk hash (what vLLM's int block hashes
  carry) XOR a 64-bit tag of the model, since events name the model in their topic only. The
  layout, world size and cache salt are not in events, so the index cannot tell namespaces apart:
  its answer is "some namespace of this model holds the chunk" (see docs/fleet.md);
- owners are a small int per key: an instance slot (>= 0, shared small-int objects), or, for a
  chunk held by several instances, the bitwise complement of a bitmap of slots (< 0);
- per slot, its keys, so an instance that resyncs or disappears is dropped in time proportional to
  what it held, not to the whole index. They are dicts of int -> None, not sets: CPython's garbage
  collector untracks dicts holding only ints, but walks every element of every set on each full
  collection, which with 10 M keys stalled the event loop for a good part of a second.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterable

MASK64 = (1 << 64) - 1
MAX_KEYS_PER_SLOT = 1 << 23  # one instance's claims; past it new keys are ignored (lookups fall back to fan-out)


def model_tag(model: str) -> int:
    return int.from_bytes(hashlib.blake2b(model.encode(), digest_size=8).digest(), "big")


def low64(block_hash: bytes | int) -> int:
    """A block hash as the index keys it: 32-byte hashes by their last 8 bytes (big-endian), ints as they are."""
    if isinstance(block_hash, int):
        return block_hash & MASK64
    return int.from_bytes(block_hash[-8:], "big")


class PrefixIndex:
    """Chunk key -> owning instance slots, plus each slot's keys. Single-threaded (the event loop)."""

    def __init__(self, max_per_slot: int = MAX_KEYS_PER_SLOT) -> None:
        self.max_per_slot = max_per_slot
        self.overflow = 0  # keys ignored because their instance was at its cap
        self._owners: dict[int, int] = {}
        self._held: dict[int, dict[int, None]] = {}
        self._tags: dict[str, int] = {}

    def tag(self, model: str) -> int:
        tag = self._tags.get(model)
        if tag is None:
            if len(self._tags) > 65536:  # bounded: tags are cheap to recompute
                self._tags.clear()
            tag = self._tags[model] = model_tag(model)
        return tag

    def keys(self, model: str, hashes: Iterable[bytes | int]) -> list[int]:
        tag = self.tag(model)
        return [low64(h) ^ tag for h in hashes]

    # -- updates ---------------------------------------------------------------------------------
    def add(self, slot: int, keys: Iterable[int]) -> None:
        held = self._held.setdefault(slot, {})
        owners, bit = self._owners, 1 << slot
        for k in keys:
            if k in held:
                continue
            if len(held) >= self.max_per_slot:
                self.overflow += 1
                continue
            held[k] = None
            o = owners.get(k)
            if o is None:
                owners[k] = slot
            elif o >= 0:
                owners[k] = ~((1 << o) | bit)
            else:
                owners[k] = ~(~o | bit)

    def remove(self, slot: int, keys: Iterable[int]) -> None:
        held = self._held.get(slot)
        if not held:
            return
        owners, bit = self._owners, 1 << slot
        for k in keys:
            if k not in held:
                continue
            del held[k]
            self._unown(owners, k, slot, bit)

    def clear(self, slot: int) -> int:
        """Forget everything `slot` claimed (a resync, a restart, an instance that left); returns how much."""
        held = self._held.pop(slot, None)
        if not held:
            return 0
        owners, bit = self._owners, 1 << slot
        for k in held:
            self._unown(owners, k, slot, bit)
        return len(held)

    @staticmethod
    def _unown(owners: dict[int, int], k: int, slot: int, bit: int) -> None:
        o = owners.get(k)
        if o is None:
            return
        if o >= 0:
            if o == slot:
                del owners[k]
            return
        rest = ~o & ~bit
        if rest & (rest - 1):
            owners[k] = ~rest
        elif rest:
            owners[k] = rest.bit_length() - 1
        else:
            del owners[k]

    # -- queries ---------------------------------------------------------------------------------
    def depths(self, keys: list[int], among: int = -1) -> list[tuple[int, int]]:
        """(n, bitmap of slots) pairs, longest n first: the slots of `among` holding exactly n leading chunks.

        Slots come as bitmaps, grouped by depth, so a lookup that wants only the best few looks at
        the deepest groups and never touches the many instances holding a chunk or two.
        """
        out: list[tuple[int, int]] = []
        alive, owners = among, self._owners
        for i, k in enumerate(keys):
            o = owners.get(k)
            now = 0 if o is None else alive & ((1 << o) if o >= 0 else ~o)
            if i and alive != now:
                out.append((i, alive & ~now))
            alive = now
            if not alive:
                break
        if alive and keys:
            out.append((len(keys), alive))
        out.reverse()
        return out

    def prefixes(self, keys: list[int]) -> dict[int, int]:
        """Slot -> number of leading chunks of `keys` it holds, for every slot holding at least one."""
        return {slot: n for n, bits in self.depths(keys) for slot in slots_of(bits)}

    def held(self, slot: int) -> int:
        return len(self._held.get(slot, ()))

    def holds(self, slot: int, key: int) -> bool:
        return key in self._held.get(slot, ())

    def __len__(self) -> int:
        return len(self._owners)

    def memory_bytes(self) -> int:
        """Approximate bytes of the structures (dicts, sets, key ints; shared small ints not counted)."""
        total = sys.getsizeof(self._owners) + sys.getsizeof(self._held)
        if self._owners:
            total += len(self._owners) * sys.getsizeof(1 << 63)  # each key is its own int object
        total += sum(sys.getsizeof(~o) for o in self._owners.values() if o < 0)
        total += sum(sys.getsizeof(h) for h in self._held.values())  # keys shared with the dict
        return total


def slots_of(bits: int) -> Iterable[int]:
    """The slot numbers set in a bitmap, lowest first."""
    while bits:
        low = bits & -bits
        yield low.bit_length() - 1
        bits ^= low

"""L2 tiers as KV-event media: a chunk is announced for a tier once all its objects were written there.

What is observable decides what is published:
- stored: the write-behind reports each batch a tier accepted (`TierManager.on_put`). When the last
  object of a chunk that is complete in L1 lands in a tier, the chunk is announced with that tier's
  medium (`kvserver_l2_fs`, `kvserver_l2_redis`, `kvserver_l2_redis-cluster`, `kvserver_l2_s3`; a
  second tier of the same kind gets `_<index>` appended). Tokens and parent come from the L1 commit.
- removed: no tier here evicts on its own account that the server could see, but a prefetch that
  finds an object missing or corrupt in a tier (`TierManager.on_missing`) removes the chunk from
  that tier's announcements. Objects that vanish unobserved (Redis eviction, files deleted by hand)
  stay announced until then: routers take events as hints, and a wrong hint costs a recompute, never
  a wrong answer.

Memory is bounded: the objects recently written per tier and the chunks announced per tier are
kept in LRU-ordered maps of `MAX_TRACKED` entries; what falls out is simply forgotten (a later write
may announce it again, which routers accept as vLLM also re-announces blocks).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np

from .wire import block_removed, block_stored

if TYPE_CHECKING:
    from kvprotocol import ObjectKey
    from .tracker import EventBatcher, L1EventTracker

MAX_TRACKED = 1 << 18


def tier_media(kinds: list[str]) -> list[str]:
    """kvserver_l2_<kind> per tier; a kind seen before gets its tier index appended."""
    out: list[str] = []
    for i, kind in enumerate(kinds):
        medium = f"kvserver_l2_{kind}"
        out.append(medium if medium not in out else f"{medium}_{i}")
    return out


class L2EventTracker:
    def __init__(self, l1: L1EventTracker, batcher: EventBatcher, media: list[str], chunk_size: int) -> None:
        l1.keep_info = True
        self.l1 = l1
        self.batcher = batcher
        self.media = media
        self.chunk_size = chunk_size
        self._written: list[OrderedDict[ObjectKey, None]] = [OrderedDict() for _ in media]
        self._announced: list[OrderedDict[tuple[str, bytes], None]] = [OrderedDict() for _ in media]

    def blocks(self) -> dict[str, int]:
        return {m: len(a) for m, a in zip(self.media, self._announced)}

    def put(self, tier: int, keys: list[ObjectKey]) -> None:
        written, announced = self._written[tier], self._announced[tier]
        for key in keys:
            written[key] = None
            written.move_to_end(key)
        while len(written) > MAX_TRACKED:
            written.popitem(last=False)
        for key in keys:
            for ident in self.l1.chunks_of(key):
                block = (ident[0], ident[4])
                info = self.l1.info(ident)
                if block in announced or info is None:
                    continue
                if all(k in written for k in self.l1.keys_of(ident)):
                    announced[block] = None
                    if len(announced) > MAX_TRACKED:
                        announced.popitem(last=False)
                    tokens, parent = info
                    ext = self.l1.ext
                    self.batcher.add(
                        ident[0],
                        block_stored(
                            [ext(ident[4])],
                            ext(parent) if parent is not None else None,
                            np.frombuffer(tokens, dtype="<u4"),
                            self.chunk_size,
                            self.media[tier],
                        ),
                    )

    def missing(self, tier: int, keys: list[ObjectKey]) -> None:
        written, announced = self._written[tier], self._announced[tier]
        for key in keys:
            written.pop(key, None)
            block = (key[0], key[6])
            if block in announced:
                del announced[block]
                self.batcher.add(key[0], block_removed([self.l1.ext(key[6])], self.media[tier]))

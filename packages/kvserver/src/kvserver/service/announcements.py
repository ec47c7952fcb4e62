"""Announced chunks: what an engine is computing now and will store within a few seconds.

Why: requests that share a prefix often reach different engines within a fraction of a second (a
conversation's next turn, an agent's parallel calls). Without a word from the engine computing it,
the second engine finds nothing stored yet and computes the same prefix again, on cores the first
one needs. An engine announces the chunks a step will complete (`announce`, before its forward);
another session's lookup that stops at one of them is answered `inflight`, and the connector asks
again later instead of computing (the answer PD reservations already give, reservations.py).

An announcement is a hint, never a promise: it holds no space and leases nothing; it ends when its
`ttl_s` (at most kvprotocol's MAX_ANNOUNCE_S) runs out, so an engine that dies or lies costs a
waiting request at most that long, and then it computes. The first live announcement of a chunk
keeps it (a second engine computing the same chunk does not extend the wait). Chunks are named as
reservations name them, by (model, world size, key-space salt, chunk hash): the salt carries the
tenant's namespace, so no tenant can make another wait. Each tenant holds at most
`per_tenant` live announcements.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass

from .reservations import ChunkRef

PER_TENANT = 1 << 14  # live announced chunks per tenant
SWEEP_EVERY_S = 1.0


@dataclass(slots=True)
class Claim:
    session: str  # scoped (tenant NUL id)
    tenant: str
    deadline: float  # monotonic


class Announcements:
    def __init__(self, clock: Callable[[], float] = time.monotonic, per_tenant: int = PER_TENANT) -> None:
        self.clock = clock
        self.per_tenant = per_tenant
        self.by_chunk: dict[ChunkRef, Claim] = {}
        self.held: collections.Counter[str] = collections.Counter()  # live claims per tenant
        self.next_sweep = 0.0
        self.announced = 0  # chunks announced (counted once per claim taken or renewed)
        self.refused = 0  # chunks not announced: the tenant's cap was reached
        self.waits = 0  # lookups answered inflight because another session announced the chunk

    def announce(self, session: str, tenant: str, refs: list[ChunkRef], ttl_s: float) -> int:
        """Claim `refs` for `session` until now + ttl_s; returns how many it now holds."""
        now = self.clock()
        self._sweep(now)
        deadline, taken = now + ttl_s, 0
        for ref in refs:
            claim = self.by_chunk.get(ref)
            if claim is not None and claim.deadline > now and claim.session != session:
                continue  # another engine computes it already: the first one keeps the claim
            if claim is None:
                if self.held[tenant] >= self.per_tenant:
                    self.refused += 1
                    continue
                self.held[tenant] += 1
                self.by_chunk[ref] = Claim(session, tenant, deadline)
            else:  # its own, or an expired one (the tenant is the same: the salt names it)
                claim.session, claim.deadline = session, deadline
            taken += 1
        self.announced += taken
        return taken

    def inflight(self, ref: ChunkRef, session: str | None) -> bool:
        """Whether another session announced `ref` and may still store it."""
        claim = self.by_chunk.get(ref)
        if claim is None:
            return False
        if claim.deadline <= self.clock():
            self._forget(ref, claim)
            return False
        if claim.session == session:
            return False
        self.waits += 1
        return True

    def describe(self) -> dict[str, int]:
        return {
            "live": len(self.by_chunk),
            "announced": self.announced,
            "refused": self.refused,
            "waits": self.waits,
        }

    def _sweep(self, now: float) -> None:
        """Drop expired claims, at most once a second (each costs one pass over the live ones)."""
        if now < self.next_sweep or not self.by_chunk:
            return
        self.next_sweep = now + SWEEP_EVERY_S
        for ref, claim in [(r, c) for r, c in self.by_chunk.items() if c.deadline <= now]:
            self._forget(ref, claim)

    def _forget(self, ref: ChunkRef, claim: Claim) -> None:
        del self.by_chunk[ref]
        self.held[claim.tenant] -= 1
        if self.held[claim.tenant] <= 0:
            del self.held[claim.tenant]

"""Read operations: lookup (with L2), query, pin, retrieve and release, over the state; and the
announcements of chunks being computed that a lookup answers `inflight` for (announcements.py).

A lookup walks the prefix (keys.py), charges and opens its session (session_admission.py), leases
the hit (leases.py), and leaves the eviction-policy touches and hit hooks for after the reply.
May import: the service's own modules, `l1`, `security`, `l2` (types only), `errors`.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from kvprotocol import ObjectKey
from kvprotocol._replies import (
    AnnounceReply,
    LookupReply,
    PinReply,
    QueryReply,
    ReleaseReply,
    RetrievedObject,
    RetrieveReply,
)
from kvprotocol._requests import Announce, KeysRequest, Lookup, Query, Release, Retrieve

from ..errors import NotLeased, OutOfRange
from .corruption import CorruptionChecks
from .keys import KeyPlanner
from .session_admission import SessionAdmission
from ..security.tenants import ADMIN, Identity

if TYPE_CHECKING:
    from .state import CacheState


class ReadOps:
    """lookup, lookup_l2, announce, query, query_l2, set_pinned, retrieve, release."""

    def __init__(self, state: CacheState, keys: KeyPlanner, sessions: SessionAdmission) -> None:
        self.state = state  # its l2 and defer are set by the server after this is built: read per call
        self.l1, self.leases, self.groups, self.counters = state.l1, state.leases, state.groups, state.counters
        self.ledger, self.reservations, self.hooks = state.ledger, state.reservations, state.hooks
        self.announcements = state.announcements
        self.background, self.object_sizes, self.chunk_size = state.background, state.object_sizes, state.chunk_size
        self.sessions = sessions
        self.corruption = CorruptionChecks(state)
        # the planner's methods, bound once: a lookup calls them without another attribute hop
        self._hashes, self._per_chunk, self._find_tail = keys.hashes, keys.per_chunk, keys.find_tail
        self._prefix_hits, self._chunk_keys = keys.prefix_hits, keys.chunk_keys

    # -- lookup / query --------------------------------------------------------------------------
    def lookup(
        self, f: Lookup, who: Identity = ADMIN, hashes: list[bytes] | None = None, tails: bool = True
    ) -> LookupReply:
        """The prefix of f's tokens ready in L1 (leased to f.session): its full chunks, then with
        f.tails (and `tails`: not while an L2 prefetch may still extend them) a stored tail after them."""
        ks, salt = f.keyspace.key(), who.salt(f.salt)
        hashes = self._hashes(f, self._per_chunk(f), who) if hashes is None else hashes
        session = None if f.session is None else who.scope(f.session)
        chunk_keys: list[list[ObjectKey]] = []  # each hit chunk's keys (no geometry), built once
        hit = self._prefix_hits(ks, salt, hashes, chunk_keys)
        full, full_hashes, hit_tokens, num_chunks = hit, hashes, hit * self.chunk_size, len(hashes)
        if f.tails and tails and len(f.tokens) // 4 > hit_tokens:
            tail = self._find_tail(f, ks, salt, hashes, hit)
            if tail is not None:  # the tail is chunk `hit` of this hit: leased, retrieved, touched as one
                length, tail_hash, tail_keys = tail
                hashes = [*hashes[:hit], tail_hash]
                chunk_keys.append(tail_keys)
                hit, hit_tokens, num_chunks = hit + 1, hit_tokens + length, max(num_chunks, hit + 1)
                self.counters.lookup_tail_hits += 1
        if session is not None:  # charged for its hit only: a miss holds nothing
            self.sessions.admit(session, hit * (1 + self._per_chunk(f)), who)
        c = self.counters
        c.lookups += 1
        c.lookup_tokens += len(f.tokens) // 4
        c.lookup_hit_tokens += hit_tokens
        t = self.ledger.counters(who)
        t.lookups += 1
        t.lookup_tokens += len(f.tokens) // 4
        t.lookup_hit_tokens += hit_tokens
        rank = f.rank
        if rank is not None and rank >= ks[1]:
            raise OutOfRange("rank must be < world_size")
        out = LookupReply(hit_tokens, hit, num_chunks, self.chunk_size)
        plan, keys_of = self.groups.plan(ks), None
        if plan is not None:  # per-group geometry: the objects this hit needs (groups.py)
            keys_of = plan.lease_keys(salt, hashes, hit)
            self.state.defer(lambda: plan.touch_hit(salt, hashes, hit, self.l1.touch, self.hooks.hit))
        elif chunk_keys:
            self.state.defer(lambda: self._touch_hit(chunk_keys))
        # the full chunk the hit stops at (a tail or not) being written or computed elsewhere: that
        # chunk, with all after it, is worth a step's wait more than the tail standing in for it
        if self.reservations.live and full < len(full_hashes):
            refs = [(ks[0], ks[1], salt, h) for h in full_hashes[: full + 1]]
            if self.reservations.inflight(refs, full):  # "ask again later": nothing is leased for it
                out.inflight = True
                return out
        announced = self.announcements
        if (
            announced.by_chunk
            and full < len(full_hashes)
            and announced.inflight((ks[0], ks[1], salt, full_hashes[full]), session)
        ):
            out.inflight = True  # another engine computes that chunk now: ask again later
            return out
        if session is not None and hit == 0 and rank is None:
            self.leases.drop(session)  # nothing to lease: no session is left for the client to release
        elif session is not None:  # a repeated lookup replaces the earlier leases (of that rank only, with rank)
            self.leases.take(session, ks, salt, hashes, hit, rank, keys_of)
        return out

    def announce(self, f: Announce, who: Identity = ADMIN) -> AnnounceReply:
        """The session computes the chunks from f.start_chunk on and stores them within f.ttl_s."""
        ks, salt = f.keyspace.key(), who.salt(f.salt)
        hashes = self._hashes(f, self._per_chunk(f), who)
        if f.start_chunk > len(hashes):
            raise OutOfRange("start_chunk beyond the last full chunk")
        refs = [(ks[0], ks[1], salt, h) for h in hashes[f.start_chunk :]]
        return AnnounceReply(self.announcements.announce(who.scope(f.session), who.tenant, refs, f.ttl_s))

    def _touch_hit(self, chunk_keys: list[list[ObjectKey]]) -> None:
        """A plain lookup's bookkeeping, after its reply: recency and the hit hooks (L2 admission)."""
        self.l1.touch_many([key for keys in reversed(chunk_keys) for key in keys])  # tail first: head most recent
        if self.hooks.hit:
            hit_keys = [k for keys in chunk_keys for k in keys]
            for hook in self.hooks.hit:
                hook(hit_keys)

    async def lookup_l2(self, f: Lookup, who: Identity = ADMIN) -> LookupReply:
        """lookup, after loading what L2 holds of the missing prefix into L1 (a bounded wait).

        The answer counts only what is in L1 when the wait ends; see l2/prefetch.py.
        """
        ks, salt = f.keyspace.key(), who.salt(f.salt)
        hashes = self._hashes(f, self._per_chunk(f), who)
        if f.session is not None:
            self.sessions.admit(who.scope(f.session), 0, who)  # the counts now; its hit's objects in lookup
        hit = self._prefix_hits(ks, salt, hashes)
        pending, reach = False, None
        if self.state.l2 is not None and hit < len(hashes):
            plan = self.groups.plan(ks)  # with a geometry, snapshots and states are useful without a leading run
            sets = [self._chunk_keys(ks, salt, h) for h in hashes] if plan is None else plan.prefetch_sets(salt, hashes)
            tokens = f.tokens
            record = (ks, salt, hashes[-1])  # the whole prefix: a hit that grew meanwhile finds the same record

            async def prefetch() -> None:
                l2 = self.state.l2
                assert l2 is not None
                located = None if f.wait else (lambda end: self.background.located(record, end))
                await l2.prefetch(
                    sets,
                    hit if plan is None else 0,
                    lambda key: self.object_sizes.get(key[1]),
                    leading=plan is None,
                    located=located,
                )
                self.l1.link_chain(ks[0], ks[1], salt, hashes)
                for hook in self.hooks.prefetched:
                    hook(ks, salt, tokens, hashes, hit)

            if f.wait:
                await prefetch()
            else:  # answer now; the engine asks again (see l2/background.py)
                l2 = self.state.l2
                pending = self.background.poll(record, prefetch)
                if pending and f.expect and plan is None:  # a streamed load's target: wait for the contains step
                    reach = await self.background.expected(record, l2.prefetch_timeout)
                    now = self._prefix_hits(ks, salt, hashes)
                    if f.progress and reach is not None and now < reach:  # a streamed load's poll: the next chunk
                        inflight = l2.prefetcher.inflight
                        loads = [inflight[k] for k in sets[now] if k in inflight]
                        await self.background.progress(record, loads, l2.prefetch_timeout)
        # no await since the wait: the prefix is recomputed and leased at once; a tail only where no
        # prefetch may still bring the full chunk it stands in for
        out = self.lookup(f, who, hashes, tails=not pending)
        if not f.wait:
            out.pending = pending
            if reach is not None:
                out.expected_tokens = max(reach, out.hit_chunks) * self.chunk_size
        return out

    def _query_keys(self, f: KeysRequest, who: Identity) -> tuple[list[bytes], list[list[ObjectKey]]]:
        ks, salt = f.keyspace.key(), who.salt(f.salt)
        hashes = self._hashes(f, self._per_chunk(f), who)
        return hashes, [self._chunk_keys(ks, salt, h, c) for c, h in enumerate(hashes)]

    def query(self, f: Query, who: Identity = ADMIN) -> QueryReply:
        """Per-chunk presence in L1 (objects ready of objects needed) and the reusable prefix."""
        return self._query(f, who)[0]

    def _query(self, f: Query, who: Identity) -> tuple[QueryReply, list[list[ObjectKey]]]:
        hashes, per_chunk = self._query_keys(f, who)
        ready = self.l1.ready
        present = [sum(1 for k in keys if ready(k) is not None) for keys in per_chunk]
        # rows stay maps: query_l2 adds one count per L2 tier, named after the tier ("l2", "l2.<i>")
        chunks: list[dict[str, Any]] = [
            {"hash": h.hex(), "l1": n, "objects": len(keys)} for h, n, keys in zip(hashes, present, per_chunk)
        ]
        hit = next((i for i, (n, keys) in enumerate(zip(present, per_chunk)) if n < len(keys)), len(chunks))
        if self.groups.plan(f.keyspace.key()) is not None:  # not a plain prefix rule: the fold decides
            hit = self._prefix_hits(f.keyspace.key(), who.salt(f.salt), hashes)
        return QueryReply(chunks, hit * self.chunk_size, self.chunk_size), per_chunk

    async def query_l2(self, f: Query, who: Identity = ADMIN) -> QueryReply:
        """query, plus presence per L2 tier: `l2` when one tier is configured, `l2.<i>` for each of several.

        A tier that is down or slower than the prefetch timeout reports nothing for that query.
        """
        result, per_chunk = self._query(f, who)
        l2 = self.state.l2
        if l2 is None:
            return result
        flat = [k for keys in per_chunk for k in keys]
        per_tier = await l2.presence(flat)
        names = ["l2"] if len(per_tier) == 1 else [f"l2.{i}" for i in range(len(per_tier))]
        for name, present in zip(names, per_tier):
            if present is None:
                continue
            pos = 0
            for chunk, keys in zip(result.chunks, per_chunk):
                chunk[name] = sum(present[pos : pos + len(keys)])
                pos += len(keys)
        return result

    def set_pinned(self, f: KeysRequest, pinned: bool, who: Identity = ADMIN) -> PinReply:
        ks, salt = f.keyspace.key(), who.salt(f.salt)
        changed = 0
        for c, h in enumerate(self._hashes(f, self._per_chunk(f), who)):
            for key in self._chunk_keys(ks, salt, h, c):
                changed += self.l1.set_pinned(key, pinned)
        return PinReply(changed)

    # -- retrieve ------------------------------------------------------------------------------
    def retrieve(self, f: Retrieve, who: Identity = ADMIN) -> tuple[RetrieveReply, list[bytes]]:
        """Offsets (shm) or copies (tcp) of one rank's leased objects, and the reader's lease number.

        tcp frames are copies, never views of the arena: a frame may wait in ZMQ's queue after the
        lease ends, and a view would then send whatever object reuses the slot.
        """
        start, end, rank = f.start_chunk, f.end_chunk, f.rank
        reader = self.leases.reader(who.scope(f.session), rank)
        if not start <= end <= reader.hit_chunks:
            raise NotLeased(f"chunks [{start}, {end}) not within the leased prefix of {reader.hit_chunks} chunks")
        mode = f.mode
        objects: list[RetrievedObject] = []
        frames: list[bytes] = []
        for chunk, group, key in self.groups.retrieve_objects(
            reader.keyspace, reader.salt, reader.hashes, reader.hit_chunks, rank, start, end
        ):
            entry = self.l1.entries[key]  # leased, so present and ready
            shm = mode == "shm"
            objects.append(RetrievedObject(chunk, group, entry.size, entry.checksum, entry.offset if shm else None))
            if not shm:
                frames.append(bytes(self.l1.arena.read(entry.offset, entry.size)))
            self.counters.retrieved_bytes += entry.size
        self.counters.retrieves += 1
        t = self.ledger.counters(who)
        t.retrieves += 1
        t.retrieved_bytes += sum(o.size for o in objects)
        return RetrieveReply(objects, reader.lease), frames

    # -- sessions ------------------------------------------------------------------------------
    def release(self, f: Release, who: Identity = ADMIN) -> ReleaseReply | Awaitable[ReleaseReply]:
        """`{released, intact, dropped}`: see leases.Leases.release; a release that reports corrupt
        chunks answers once the server has checked them (corruption.py), so it gives an awaitable."""
        held = self.corruption.hold(who.scope(f.session), f.rank, f.corrupt) if f.corrupt and f.rank is not None else []
        result = self.leases.release(who.scope(f.session), f.rank, f.lease)
        if f.lease is not None and not result.intact:
            self.counters.broken_reads += 1
        if not held:
            return result

        async def checked() -> ReleaseReply:
            result.dropped = await self.corruption.settle(held)
            return result

        return checked()


__all__ = ["ReadOps"]

"""CacheBlend on the server: a content index next to the prefix keys, blend_store and blend_lookup.

Why apart from the prefix ops (service/reads.py): a blend hit is a different promise from a prefix
hit. A prefix hit is KV that is exact for the request; a blend hit is KV of the same document
computed at another position and without the request's earlier context, which the engine must
re-RoPE and partly recompute (kvconnector.blend). Its counters therefore never mix with the prefix
counters, and nothing here changes what `lookup` answers. Admission is shared: its stores go through
the prefix stores' `StoreAdmission`, its sessions through `SessionAdmission`, its keys through the
`KeyPlanner` (all three on the same `CacheState`).

Objects are ordinary L1 objects (same slabs, eviction, leases, commit, retrieve); only their
chunk-hash field differs: `blend_object_hash(content fingerprint, reference position)`. The index maps
(keyspace, salt, fingerprint) to the reference position and object hash of the newest committed copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvprotocol import MAX_KEYS, ObjectKey, blend_fingerprints, blend_object_hash
from kvprotocol._replies import BlendLookupReply, BlendMatch, BlendSlot, BlendStoreReply
from kvprotocol._requests import BlendLookup, BlendStore

from ..errors import OutOfRange, TooLarge
from ..service.keys import KeyPlanner
from ..service.admission import MAX_STORES
from ..service.leases import rank_keys
from ..security.tenants import Identity
from ..service.sessions import Slot, StoreTxn, new_store_id
from ..service.state import CacheState

IndexKey = tuple[str, int, tuple[str, ...], str, bytes]  # (model, world, groups, salt, fingerprint)
MAX_PENDING = MAX_STORES  # blend stores awaiting commit whose index entries are held back


@dataclass
class BlendCounters:
    lookups: int = 0
    lookup_tokens: int = 0  # prompt tokens of blend lookups
    candidate_chunks: int = 0  # full chunks of the given segments
    hit_chunks: int = 0
    hit_tokens: int = 0
    stores: int = 0
    stored_objects: int = 0
    stored_bytes: int = 0
    deduplicated_objects: int = 0
    no_space: int = 0


class BlendService:
    """blend_store / blend_lookup over the cache state's L1, sessions and store transactions, with the
    prefix ops' key planner, session admission and store admission."""

    def __init__(self, state: CacheState, keys: KeyPlanner) -> None:
        self.state, self.keys = state, keys
        self.chunk_size = state.chunk_size
        self.counters = BlendCounters()
        self.index: dict[IndexKey, tuple[int, bytes]] = {}  # -> (reference position, object hash)
        # (model, world, salt, object hash) -> the entries naming that object (one per group layout set)
        self._by_object: dict[tuple[str, int, str, bytes], set[IndexKey]] = {}
        self._pending: dict[str, list[tuple[IndexKey, int, bytes]]] = {}  # store id -> entries at commit
        state.hooks.commit_txn.append(self._committed)
        state.l1.on_evict.append(self._gone)
        state.l1.on_clear.append(self._gone)

    # -- index ---------------------------------------------------------------------------------
    def _publish(self, ik: IndexKey, ref_pos: int, obj: bytes) -> None:
        old = self.index.get(ik)
        if old is not None:
            self._unlink(ik, old[1])
        self.index[ik] = (ref_pos, obj)
        self._by_object.setdefault((ik[0], ik[1], ik[3], obj), set()).add(ik)

    def _unlink(self, ik: IndexKey, obj: bytes) -> None:
        rev = (ik[0], ik[1], ik[3], obj)
        names = self._by_object.get(rev)
        if names is not None:
            names.discard(ik)
            if not names:
                del self._by_object[rev]

    def _gone(self, key: ObjectKey) -> None:
        """An object left L1: its chunk can no longer hit, so the entries naming it go too (the index
        therefore never holds more entries than L1 holds blend objects)."""
        model, layout_fp, world, salt, obj = key[0], key[1], key[2], key[5], key[6]
        names = self._by_object.get((model, world, salt, obj))
        if not names:
            return
        for ik in [ik for ik in names if layout_fp in ik[2]]:
            self._unlink(ik, obj)
            if self.index.get(ik, (0, b""))[1] == obj:
                del self.index[ik]

    def _committed(self, txn: StoreTxn) -> None:
        for entry in self._pending.pop(txn.id, []):
            self._publish(*entry)
        if txn.kind == "blend":
            self.counters.stored_objects += len(txn.slots)
            self.counters.stored_bytes += sum(s.entry.size for s in txn.slots)

    def _sweep_pending(self) -> None:
        for store_id in [s for s in self._pending if s not in self.state.table.stores]:
            del self._pending[store_id]  # aborted or expired: nothing to publish

    # -- ops -----------------------------------------------------------------------------------
    def store(self, f: BlendStore, who: Identity) -> BlendStoreReply:
        """Reserve slots for one segment's full chunks; commit (the ordinary op) publishes them.
        The salt and session are the caller's, inside its tenant's namespace (`who`)."""
        c = self.state
        ks, salt, rank = f.keyspace.key(), who.salt(f.salt), f.rank
        if rank >= ks[1]:
            raise OutOfRange("rank must be < world_size")
        sizes = c.admission.sizes(ks)
        chunks = len(f.tokens) // 4 // self.chunk_size
        if chunks * len(ks[2]) > MAX_KEYS:
            raise TooLarge(f"{chunks} chunks x {len(ks[2])} groups is over {MAX_KEYS} objects per request")
        pos_base = f.pos_base
        fps = blend_fingerprints(f.tokens, self.chunk_size)
        if fps and pos_base + len(fps) * self.chunk_size > 0xFFFFFFFF:
            raise OutOfRange("pos_base + tokens beyond uint32 positions")
        # the prefix stores' admission: store caps, then per object bookings, the tenant's quota, the arena
        c.admission.open(who, full=lambda: len(self._pending) >= MAX_PENDING, sweep=self._sweep_pending)
        admit = c.admission.objects(who)
        session = who.scope(f.session) if f.session is not None else None
        # like a prefix store, only its owner may commit or abort it
        txn = StoreTxn(new_store_id(), f.mode, session, [], c.table.deadline(), kind="blend", owner=who.tenant)
        reply_slots: list[BlendSlot] = []
        pending: list[tuple[IndexKey, int, bytes]] = []
        for chunk, fp in enumerate(fps):
            ref_pos = pos_base + chunk * self.chunk_size
            obj = blend_object_hash(fp, ref_pos)
            ik: IndexKey = (ks[0], ks[1], ks[2], salt, fp)
            reserved_here = False
            for group, key in enumerate(rank_keys(ks, salt, rank, [obj])):
                got = admit.take(key, sizes[group])
                if isinstance(got, str):
                    if got == "no_space":
                        self.counters.no_space += 1
                    else:
                        self.counters.deduplicated_objects += 1
                    reply_slots.append(BlendSlot(chunk, group, got, ref_pos=ref_pos))
                    continue
                reserved_here = True
                txn.slots.append(Slot(key, chunk, group, got))
                offset = got.offset if txn.mode == "shm" else None
                reply_slots.append(BlendSlot(chunk, group, "reserved", got.size, offset, ref_pos=ref_pos))
            if reserved_here:
                pending.append((ik, ref_pos, obj))
            elif all(c.l1.ready(k) is not None for k in rank_keys(ks, salt, rank, [obj])):
                self._publish(ik, ref_pos, obj)  # already there (this rank): findable now
        if txn.slots:
            c.table.stores[txn.id] = txn
            self._pending[txn.id] = pending
        self.counters.stores += 1
        return BlendStoreReply(txn.id if txn.slots else None, reply_slots, self.chunk_size)

    def lookup(self, f: BlendLookup, who: Identity) -> BlendLookupReply:
        """Cached chunks of the prompt's segments, wherever they sit: `matches` in prompt order, each
        with its token offset `start` and the `ref_pos` its KV was computed at. With a session, the
        matched objects are leased and `retrieve` chunk i is match i."""
        c = self.state
        ks, salt, tokens = f.keyspace.key(), who.salt(f.salt), f.tokens
        session = who.scope(f.session) if f.session is not None else None
        n_tokens = len(tokens) // 4
        starts: list[int] = f.starts
        if starts[-1] >= n_tokens:
            raise OutOfRange(f"segment start {starts[-1]} beyond {n_tokens} tokens")
        per_chunk = ks[1] * len(ks[2])
        bounds = list(zip(starts, [*starts[1:], n_tokens]))
        candidates = sum((end - start) // self.chunk_size for start, end in bounds)
        if candidates * per_chunk > MAX_KEYS:
            raise TooLarge(f"{candidates} chunks x {per_chunk} objects each is over {MAX_KEYS} objects per request")
        rank = f.rank
        if rank is not None and rank >= ks[1]:
            raise OutOfRange("rank must be < world_size")
        if session is not None:
            c.sessions.admit(session, 0, who)  # the session counts (the tenant's cap too); its hits below
        matches: list[BlendMatch] = []
        objects: list[bytes] = []
        for start, end in bounds:
            for i, fp in enumerate(blend_fingerprints(tokens[4 * start : 4 * end], self.chunk_size)):
                hit = self.index.get((ks[0], ks[1], ks[2], salt, fp))
                if hit is None:
                    continue
                keys = self.keys.chunk_keys(ks, salt, hit[1])
                if any(c.l1.ready(k) is None for k in keys):
                    continue
                for k in keys:
                    c.l1.touch(k)
                matches.append(BlendMatch(start + i * self.chunk_size, hit[0]))
                objects.append(hit[1])
        n = self.counters
        n.lookups += 1
        n.lookup_tokens += n_tokens
        n.candidate_chunks += candidates
        n.hit_chunks += len(matches)
        n.hit_tokens += len(matches) * self.chunk_size
        if session is not None:  # charged for what it holds: its matches, like a prefix lookup's hit
            c.sessions.admit(session, len(objects) * (1 + per_chunk), who)
            c.leases.take(session, ks, salt, objects, len(objects), rank)
        return BlendLookupReply(matches, candidates, len(matches) * self.chunk_size, self.chunk_size)

    def describe(self) -> dict[str, Any]:
        return {"index_entries": len(self.index), "pending_stores": len(self._pending), **vars(self.counters)}


__all__ = ["BlendCounters", "BlendService", "IndexKey"]

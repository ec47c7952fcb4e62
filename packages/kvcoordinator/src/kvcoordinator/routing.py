"""Fleet lookup: answered from the prefix index where an instance's feed is in sync, by fan-out elsewhere.

- `auto` (default): instances whose KV-events feed is in sync are answered from the index (no
  request to them); the others (no events, resyncing, topic not indexable) are asked directly;
- `verify`: the index picks the candidates (the best few), which are then asked directly, so
  the answer respects the layout, world size and salt of the body, which events do not carry;
- `fanout`: every live instance is asked, as before the index existed.

The answer lists the instances that hold at least one chunk (best first) and every instance that
was asked and failed, each with where its figure came from (`source`).
"""

from __future__ import annotations

import heapq
from typing import Any

import httpx

from kvprotocol import chunk_hashes
from kvprotocol._hashing import token_count

from .credentials import InstanceCredentials
from .fanout import Outcome, fleet_query
from .index import slots_of
from .models import LookupBody
from .registry import Instance, Registry
from .subscriber import EventFeeds

VERIFY_CANDIDATES = 4
MAX_LISTED = 16


def _load(inst: Instance) -> float:
    return inst.l1_used_bytes / inst.l1_capacity_bytes if inst.l1_capacity_bytes else 1.0


def from_index(
    feeds: EventFeeds, registry: Registry, model: str, tokens: list[int] | bytes, best: int
) -> dict[str, int]:
    """Instance id -> reusable prefix (tokens) by the index, for fresh in-sync instances holding a chunk,
    best first: longest prefix, then least loaded, then id.

    Work is proportional to the chunks of the prompt and the instances that hold them, not to the
    fleet: an instance past its timeout but not yet pruned is skipped here by its age. Only the
    deepest instances are looked at, stopping once `best` are found and their depth group is
    complete (ties at the boundary are broken by load here), and only the best `best` returned.
    """
    found: list[tuple[int, float, str]] = []  # (-prefix, load, id): plain tuples sort fastest
    now, instances, timeout, by_slot = registry.clock(), registry.instances, registry.timeout, feeds.by_slot
    for chunk in feeds.chunk_sizes():
        among = feeds.synced_slots(chunk)
        if token_count(tokens) < chunk or not among:
            continue
        here = 0
        for n, bits in feeds.index.depths(feeds.index.keys(model, chunk_hashes(tokens, chunk)), among):
            if here >= best:
                break
            for slot in slots_of(bits):
                feed = by_slot.get(slot)
                inst = instances.get(feed.inst.id) if feed is not None else None
                if inst is not None and now - inst.last_seen <= timeout:
                    found.append((-n * chunk, _load(inst), inst.id))
                    here += 1
    return {inst_id: -neg for neg, _, inst_id in heapq.nsmallest(best, found)}


async def fleet_lookup(
    client: httpx.AsyncClient,
    creds: InstanceCredentials,
    feeds: EventFeeds | None,
    registry: Registry,
    body: LookupBody,
    timeout: float,
    outcome: Outcome,
) -> dict[str, Any]:
    tokens, mode = body.tokens, body.mode
    if feeds is None or mode == "fanout":
        ask, indexed = registry.live(), 0
    elif feeds.in_sync == len(registry.instances):  # the usual case: nobody to ask, no O(fleet) scan
        ask, indexed = [], feeds.in_sync
    else:
        ask = [i for i in registry.live() if not feeds.synced(i.id)]
        indexed = feeds.in_sync
    rows: dict[str, dict[str, Any]] = {}
    known = registry.instances
    if indexed and feeds is not None:
        prefixes = from_index(
            feeds, registry, body.model, tokens, VERIFY_CANDIDATES if mode == "verify" else MAX_LISTED
        )
        if mode == "verify":
            ask += [known[i] for i in prefixes]  # already the best VERIFY_CANDIDATES, best first
        else:
            for inst_id, prefix in prefixes.items():  # the best ones: the answer lists no more
                rows[inst_id] = _row(known[inst_id], prefix, None, "index")
    forwarded = body.query_body() if ask else {}
    asked = await fleet_query(client, creds, ask, forwarded, timeout, outcome) if ask else []
    by_all = {i.id: i for i in ask} | {i: known[i] for i in rows if i in known}
    for inst, asked_prefix, error in asked:
        rows[inst.id] = _row(inst, asked_prefix, error, "fanout")
    answered = [r for r in rows.values() if r["prefix_tokens"] is not None]
    best = min(
        answered, key=lambda r: (-r["prefix_tokens"], _load(by_all[r["instance_id"]]), r["instance_id"]), default=None
    )
    best_prefix: int = best["prefix_tokens"] if best else 0
    order = sorted(rows.values(), key=lambda r: (-(r["prefix_tokens"] or 0), r["instance_id"]))
    listed = [r for r in order if r["source"] == "fanout"]  # every instance asked, as before the index
    listed += [r for r in order if r["source"] == "index"]
    return {
        "num_tokens": body.num_tokens,
        "prefix_tokens": best_prefix,
        "best": (
            {
                "instance_id": best["instance_id"],
                "zmq_url": best["zmq_url"],
                "http_url": by_all[best["instance_id"]].http_url,
                "prefix_tokens": best_prefix,
                "source": best["source"],
            }
            if best and best_prefix > 0
            else None
        ),
        "instances": listed,
        "indexed": indexed if mode != "verify" else 0,
        "fanned_out": len(ask),
    }


def _row(inst: Instance, prefix: int | None, error: str | None, source: str) -> dict[str, Any]:
    return {
        "instance_id": inst.id,
        "zmq_url": inst.zmq_url,
        "prefix_tokens": prefix,
        "reachable": error is None,
        "error": error,
        "source": source,
    }

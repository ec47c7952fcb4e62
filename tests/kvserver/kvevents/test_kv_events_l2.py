"""KV events for an L2 tier (fs): stored once written behind, removed when a prefetch finds it gone."""

from __future__ import annotations

import shutil
from pathlib import Path

from kvevents_util import CHUNK, BlockIndex, start_event_server, sync
from kvtestkit.kvhelpers import lookup, payload, register, store, tiny_layout
from kvprotocol import chunk_hashes, pack_tokens

TOKENS = list(range(3000, 3000 + CHUNK * 3))
SIZE = tiny_layout().object_bytes


def _events(batches, medium):
    return [ev for b in batches for ev in b.events if ev.get("medium") == medium]


def test_fs_tier_blocks_follow_write_behind_and_observed_misses(server_factory, tmp_path: Path):
    root = tmp_path / "l2"
    srv = start_event_server(server_factory, "--l1-size-gb", "0.25", "--l2", f"fs://{root}")
    sub = srv.subscriber()
    hashes = chunk_hashes(pack_tokens(TOKENS), CHUNK)
    with srv.proc.client() as c:
        ks, _ = register(c, layouts=[tiny_layout()])
        index = BlockIndex()
        index.apply(sync(sub, c, ks, srv.replay_endpoint, plain=srv.plain))
        store(c, ks, TOKENS, lambda ch, g: payload(ch, SIZE))

        # L1 at commit, then each chunk for the fs tier once its object is on disk
        batches = sub.recv_until(lambda bs: len(_events(bs, "kvserver_l2_fs")) >= 3)
        [l1] = [
            ev
            for ev in _events(batches, "kvserver_l1")
            if ev["type"] == "BlockStored" and ev["token_ids"][0] == TOKENS[0]
        ]
        assert l1["block_hashes"] == hashes
        fs = [ev for ev in _events(batches, "kvserver_l2_fs") if ev["block_hashes"][0] in hashes]
        assert sorted((ev["block_hashes"][0], ev["parent_block_hash"], tuple(ev["token_ids"])) for ev in fs) == sorted(
            (hashes[i], hashes[i - 1] if i else None, tuple(TOKENS[i * CHUNK : (i + 1) * CHUNK])) for i in range(3)
        )
        assert all(ev["type"] == "BlockStored" and ev["block_size"] == CHUNK for ev in fs)
        assert c.call("describe").result["kv_events"]["l2_blocks"]["kvserver_l2_fs"] >= 3

        # L1 cleared: the L1 blocks go, the fs blocks stay; a lookup loads them back from fs, and
        # L1 announces them again
        c.call("clear")
        removed = sub.recv_until(lambda bs: any(ev["type"] == "BlockRemoved" for b in bs for ev in b.events))
        assert all(ev["medium"] == "kvserver_l1" for b in removed for ev in b.events)
        assert lookup(c, ks, TOKENS) == 3 * CHUNK
        [back] = sub.recv_until(lambda bs: len(bs) == 1)
        [ev] = back.events
        assert (ev["type"], ev["medium"], ev["block_hashes"], ev["parent_block_hash"], ev["token_ids"]) == (
            "BlockStored",
            "kvserver_l1",
            hashes,
            None,
            TOKENS,
        )

        # then the files go behind the server's back, and the next lookup's prefetch finds them
        # missing: the fs blocks are removed too
        c.call("clear")
        sub.recv_until(lambda bs: len(bs) == 1)
        shutil.rmtree(root / "objects")
        assert lookup(c, ks, TOKENS) == 0
        gone = sub.recv_until(
            lambda bs: len([h for ev in _events(bs, "kvserver_l2_fs") for h in ev["block_hashes"] if h in hashes]) >= 3
        )
        fs_removed = _events(gone, "kvserver_l2_fs")
        assert all(ev["type"] == "BlockRemoved" for ev in fs_removed)
        assert set(hashes) <= {h for ev in fs_removed for h in ev["block_hashes"]}
    sub.close()

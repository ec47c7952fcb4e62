"""KV events from a real kvserver, read by a real ZMQ subscriber and checked against the cache's state."""

from __future__ import annotations

from kvevents_util import CHUNK, PROBE, BlockIndex, EventServer, start_event_server, sync
from kvtestkit.kvhelpers import lookup, payload, register, store, tiny_layout
from kvprotocol import chunk_hashes, pack_tokens
from kvtestkit.kvsub import Subscriber

TOKENS = list(range(1000, 1000 + CHUNK * 4 + 100))  # four full chunks and a tail
SIZE = tiny_layout().object_bytes


def _data(ch: int, g: int) -> bytes:
    return payload(ch * 10 + g, SIZE)


def _stored(batches):
    return [ev for b in batches for ev in b.events if ev["type"] == "BlockStored"]


def test_stores_publish_blocks_with_parent_chain_and_tokens(synced):
    sub, c, ks, index = synced
    hashes = chunk_hashes(pack_tokens(TOKENS), CHUNK)
    store(c, ks, TOKENS, _data)
    [first] = sub.recv_until(lambda bs: len(bs) == 1)
    assert first.topic == b"kv@test@m"
    [ev] = first.events
    assert ev == {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": None,
        "token_ids": TOKENS[: 4 * CHUNK],
        "block_size": CHUNK,
        "lora_id": None,
        "medium": "kvserver_l1",
        "lora_name": None,
    }
    assert isinstance(hashes[0], bytes) and len(hashes[0]) == 32

    # the conversation goes on: only the new chunks are announced, chained to the last cached one
    longer = TOKENS + list(range(5000, 5000 + CHUNK * 2))
    more = chunk_hashes(pack_tokens(longer), CHUNK)
    reply = store(c, ks, longer, _data)
    assert [s["status"] for s in reply["slots"]] == ["present"] * 4 + ["reserved"] * 2
    [second] = sub.recv_until(lambda bs: len(bs) == 1)
    [ev] = second.events
    assert ev["block_hashes"] == more[4:6] and ev["parent_block_hash"] == more[3]
    assert ev["token_ids"] == longer[4 * CHUNK : 6 * CHUNK]
    assert second.seq == first.seq + 1 and second.ts >= first.ts

    # storing the same prefix again changes nothing, so it says nothing
    store(c, ks, longer, _data)
    assert sub.recv(timeout_ms=300) is None
    index.apply([first, second])
    assert all(h in index.blocks for h in more)


def test_a_chunk_is_a_block_only_when_every_rank_and_group_is_in(event_server: EventServer):
    sub = event_server.subscriber()
    with event_server.proc.client() as c:
        ks, _ = register(c, layouts=[tiny_layout()])
        sync(sub, c, ks, event_server.replay_endpoint, plain=event_server.plain)
        layouts = [tiny_layout(), tiny_layout(block_bytes=2048, tag="mla")]
        ks2, _ = register(c, model="big", layouts=layouts, world_size=2)
        size = {0: layouts[0].object_bytes, 1: layouts[1].object_bytes}
        store(c, ks2, TOKENS, lambda ch, g: payload(ch, size[g]), rank=0)
        assert sub.recv(timeout_ms=300) is None  # rank 1 is missing: a lookup would not hit either
        assert lookup(c, ks2, TOKENS) == 0
        store(c, ks2, TOKENS, lambda ch, g: payload(ch, size[g]), rank=1)
        [batch] = sub.recv_until(lambda bs: len(bs) == 1)
        assert lookup(c, ks2, TOKENS) == 4 * CHUNK
        assert batch.topic == b"kv@test@big"
        [ev] = batch.events
        assert ev["block_hashes"] == chunk_hashes(pack_tokens(TOKENS), CHUNK)

        # a second namespace (another salt) holding the same chunks adds no block, and losing it
        # removes none while the first still holds them
        store(c, ks2, TOKENS, lambda ch, g: payload(ch, size[g]), rank=0, salt="tenant-x")
        store(c, ks2, TOKENS, lambda ch, g: payload(ch, size[g]), rank=1, salt="tenant-x")
        assert sub.recv(timeout_ms=300) is None
    sub.close()


def test_evictions_remove_blocks_and_events_track_the_cache(server_factory):
    srv = start_event_server(server_factory, "--l1-size-gb", "0.001")  # room for about 60 objects
    sub = srv.subscriber()
    with srv.proc.client() as c:
        ks, _ = register(c, layouts=[tiny_layout()])
        index = BlockIndex()
        index.apply(sync(sub, c, ks, srv.replay_endpoint, plain=srv.plain))
        prompts = [[p * 10_000 + t for t in range(CHUNK * 4)] for p in range(1, 41)]  # 160 objects
        for prompt in prompts:
            store(c, ks, prompt, _data)
        evictions = c.call("describe").result["l1"]["evictions"]
        assert evictions > 50
        batches = sub.recv_until(
            lambda bs: (
                sum(len(ev["block_hashes"]) for b in bs for ev in b.events if ev["type"] == "BlockRemoved")
                >= evictions - 10
            )
        )
        batches += _drain(sub)
        index.apply(batches)
        assert index.seqs == list(range(len(index.seqs)))
        removed = [ev for b in batches for ev in b.events if ev["type"] == "BlockRemoved"]
        assert removed and all(ev["medium"] == "kvserver_l1" for ev in removed)
        _assert_index_matches_cache(c, ks, index, prompts)

        # clear: every block still held is removed, and the index ends empty (the probes included)
        c.call("clear")
        index.apply(sub.recv_until(lambda bs: len(bs) == 1) + _drain(sub))
        assert index.blocks == {}
        _assert_index_matches_cache(c, ks, index, prompts)
    sub.close()


def _drain(sub: Subscriber) -> list:
    out = []
    while (b := sub.recv(timeout_ms=300)) is not None:
        out.append(b)
    return out


def _assert_index_matches_cache(c, ks, index: BlockIndex, prompts) -> None:
    """Each chunk is announced exactly when the server says all its objects are in L1."""
    for prompt in prompts:
        chunks = c.call("query", keyspace=ks.to_wire(), tokens=pack_tokens(prompt)).result["chunks"]
        for chunk in chunks:
            present = chunk["l1"] == chunk["objects"]
            assert (bytes.fromhex(chunk["hash"]) in index.blocks) == present, chunk


def test_late_subscriber_replays_what_it_missed(event_server: EventServer):
    with event_server.proc.client() as c:
        ks, _ = register(c, layouts=[tiny_layout()])
        store(c, ks, TOKENS, _data)  # nobody listens yet
        c.call("clear")
    everything = event_server.replay(0)
    assert [b.seq for b in everything] == list(range(len(everything)))
    assert everything[0].events == [{"type": "AllBlocksCleared"}]  # a fresh server holds nothing
    assert _stored(everything)[0]["token_ids"] == TOKENS[: 4 * CHUNK]
    index = BlockIndex()
    index.apply(everything)
    assert index.blocks == {}  # the clear removed what the store added

    # a restarted subscriber asks only from where it stopped
    tail = event_server.replay(everything[-1].seq)
    assert [(b.seq, b.payload) for b in tail] == [(everything[-1].seq, everything[-1].payload)]
    assert event_server.replay(10**9) == []
    assert event_server.proc.stop() == 0  # the sockets close cleanly on SIGTERM


def test_malformed_replay_requests_are_ignored(event_server: EventServer):
    import zmq

    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.plain_username, sock.plain_password = (p.encode() for p in event_server.plain)
        sock.connect(event_server.replay_endpoint)
        sock.send_multipart([b"", b"\x00\x01"])  # not 8 bytes
        sock.send_multipart([b"", b"x" * 2000])  # over the size limit: the connection is dropped
        assert not sock.poll(300)
    finally:
        ctx.destroy(linger=0)
    assert event_server.replay(0)[0].events == [{"type": "AllBlocksCleared"}]
    with event_server.proc.client() as c:
        kv = c.call("describe").result["kv_events"]
    assert kv["bad_replays"] >= 1 and kv["replays"] >= 1


def test_a_restarted_subscriber_replays_exactly_what_it_missed(event_server: EventServer):
    sub = event_server.subscriber()
    with event_server.proc.client() as c:
        ks, _ = register(c, layouts=[tiny_layout()])
        index = BlockIndex()
        index.apply(sync(sub, c, ks, event_server.replay_endpoint, plain=event_server.plain))
        store(c, ks, TOKENS, _data)
        index.apply(sub.recv_until(lambda bs: len(bs) == 1))
        sub.close()  # the router restarts; meanwhile the cache moves on
        longer = [*TOKENS[: 4 * CHUNK], *range(9000, 9000 + CHUNK)]
        store(c, ks, longer, _data)
        c.call("clear")
        store(c, ks, TOKENS[:CHUNK], _data)

        sub = event_server.subscriber()
        missed = sync(sub, c, ks, event_server.replay_endpoint, plain=event_server.plain, start=index.seqs[-1] + 1)
        events = [ev for b in missed for ev in b.events]
        assert events[0]["type"] == "BlockStored" and events[0]["token_ids"] == longer[4 * CHUNK :]
        assert events[1]["type"] == "BlockRemoved" and set(index.blocks) <= set(events[1]["block_hashes"])
        assert events[2]["type"] == "BlockStored" and events[2]["token_ids"] == TOKENS[:CHUNK]
        index.apply(missed)
        _assert_index_matches_cache(c, ks, index, [TOKENS, longer])
        # The first chunk again; the rest are the probes the re-sync stored (one or more: ZMQ's slow
        # joiner decides how many were needed before the new subscription delivered).
        kept = [ev["token_ids"] for ev in index.blocks.values() if ev["token_ids"][0] < PROBE]
        assert kept == [TOKENS[:CHUNK]] and len(index.blocks) >= 2
    sub.close()

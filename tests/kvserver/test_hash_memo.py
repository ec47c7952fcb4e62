"""The server's memo of chunk hashes: always kvprotocol's hashes, bounded, and per key-space salt."""

from __future__ import annotations

import random

import pytest

from kvprotocol import chunk_hashes, pack_tokens
from kvserver.service.hash_memo import ENTRY_OVERHEAD, HashMemo

C = 16  # tokens per chunk: small, so many chunks are cheap


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1 << 32) for _ in range(n)]


def test_hashes_are_the_protocols_whatever_the_memo_holds():
    memo = HashMemo()
    rng = random.Random(7)
    base = tokens(40 * C, 1)
    for _ in range(300):  # prompts sharing prefixes of random lengths, some with extra keys
        cut = rng.randrange(len(base))
        t = base[:cut] + tokens(rng.randrange(5 * C), rng.randrange(1000))
        n_full = len(t) // C
        extra = (
            sorted({(i, bytes([i % 256]) * 32) for i in rng.sample(range(n_full), min(2, n_full))})
            if n_full and rng.random() < 0.3
            else []
        )
        assert memo.hashes("s", pack_tokens(t), C, extra) == chunk_hashes(t, C, extra)
    assert memo.hits > 0 and memo.misses > 0


def test_a_repeated_prefix_is_answered_from_the_memo():
    memo = HashMemo()
    head = tokens(8 * C, 2)
    memo.hashes("s", pack_tokens(head), C)
    assert (memo.hits, memo.misses) == (0, 8)
    longer = head + tokens(3 * C, 3)
    assert memo.hashes("s", pack_tokens(longer), C) == chunk_hashes(longer, C)
    assert (memo.hits, memo.misses) == (8, 11)  # the shared 8 chunks once more from the memo, 3 new ones hashed


def test_an_extra_key_is_part_of_the_entry():
    memo = HashMemo()
    t = pack_tokens(tokens(4 * C, 4))
    plain = memo.hashes("s", t, C)
    with_extra = memo.hashes("s", t, C, [(2, b"\x07" * 32)])
    assert with_extra[:2] == plain[:2] and with_extra[2:] != plain[2:]
    assert memo.hits == 2 and memo.misses == 6


def test_scopes_never_share_entries():
    """One tenant's (or cache_salt's) recent prompts do not make another's hashing faster."""
    memo = HashMemo()
    t = pack_tokens(tokens(6 * C, 5))
    assert memo.hashes("~alice~", t, C) == memo.hashes("~bob~", t, C)
    assert memo.hits == 0 and memo.misses == 12
    memo.hashes("~bob~", t, C)
    assert memo.hits == 6


def test_memory_is_bounded_and_the_least_recently_used_go_first():
    per_entry = 4 * C + ENTRY_OVERHEAD
    memo = HashMemo(max_bytes=10 * per_entry)
    hot = pack_tokens(tokens(2 * C, 6))
    memo.hashes("s", hot, C)
    for seed in range(20):
        misses = memo.misses
        memo.hashes("s", hot, C)  # used again before every newcomer: never evicted, never hashed again
        assert memo.misses == misses
        memo.hashes("s", pack_tokens(tokens(3 * C, 100 + seed)), C)
        assert memo.bytes == len(memo) * per_entry <= memo.max_bytes
    misses = memo.misses
    memo.hashes("s", pack_tokens(tokens(3 * C, 100)), C)  # the first newcomer: long gone
    assert memo.misses == misses + 3


def test_relinking_after_an_evicted_head_keeps_the_byte_count_exact():
    per_entry = 4 * C + ENTRY_OVERHEAD
    memo = HashMemo(max_bytes=3 * per_entry)
    t = pack_tokens(tokens(3 * C, 8))
    memo.hashes("s", t, C)  # chunks 0, 1, 2
    memo.hashes("s", pack_tokens(tokens(C, 9)), C)  # evicts chunk 0 only
    assert memo.hashes("s", t, C) == chunk_hashes(t, C)  # 0 hashed again; 1 and 2 were still held
    assert memo.bytes == len(memo) * per_entry <= memo.max_bytes


def test_an_extra_key_past_the_last_chunk_raises_like_chunk_hashes():
    with pytest.raises(IndexError):
        HashMemo().hashes("s", pack_tokens(tokens(2 * C, 10)), C, [(2, b"\x00" * 32)])


def test_a_prompts_save_after_its_lookup_hashes_nothing_again_and_salts_stay_apart(server):
    from kvtestkit.kvhelpers import lookup, payload, register, store, tiny_layout

    layout = tiny_layout()
    prompt = tokens(4 * 256, 11)
    with server.client() as c:
        ks, _ = register(c, layouts=[layout])

        def memo() -> tuple[int, int]:
            m = c.call("describe").result["hash_memo"]
            return m["hits"], m["misses"]

        assert memo() == (0, 0)
        assert lookup(c, ks, prompt) == 0
        assert memo() == (0, 4)
        store(c, ks, prompt, lambda ch, g: payload(ch, layout.object_bytes))
        assert memo() == (4, 4)  # the save's hashes came from the lookup's
        assert lookup(c, ks, prompt) == 4 * 256
        assert memo() == (8, 4)
        assert lookup(c, ks, prompt, salt="other") == 0  # another cache_salt: its own entries
        assert memo() == (8, 8)

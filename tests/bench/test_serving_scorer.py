"""The kvscore router's choice (bench/serving/scorer.py): session affinity beyond what the index can
tell apart, load against hits, and a bounded memory. Pure logic: the router's I/O is exercised by
tests/vllm/test_bench_serving_kv_routing.py against real engines and a real coordinator."""

from __future__ import annotations


import pytest


from bench.serving.scorer import Choice, PrefixMemory, Scorer, block_keys

SYSTEM = list(range(100, 100 + 768))  # a shared system prompt: 3 chunks of 256


def user(u: int, n: int = 200) -> list[int]:
    return [1000 + 7 * u + i % 5 for i in range(n)]


def test_block_keys_name_the_whole_prefix() -> None:
    a, b = [1] * 32 + [2] * 32, [3] * 32 + [2] * 32
    assert len(block_keys(a + [9] * 31, 32)) == 2  # only full blocks
    assert block_keys(a, 32)[1] != block_keys(b, 32)[1]  # the same block after another prefix differs


def test_a_later_turn_follows_its_session_where_the_index_ties() -> None:
    s = Scorer(2)
    for u, e in ((0, 0), (1, 1)):
        t = s.started(Choice(e, 0, False), SYSTEM + user(u))
        s.finished(t, SYSTEM + user(u) + [5] * 16)
    # Round 2: both kvservers hold the system prompt (the index ties at 768 tokens); the router's own
    # memory knows where each user's history went.
    tie = {0: 768, 1: 768}
    for u, e in ((1, 1), (0, 0)):
        c = s.choose(SYSTEM + user(u) + [5] * 16 + user(u + 10, 128), tie)
        assert c.engine == e and c.scored
        assert c.expected_hit_tokens >= 768 + 192


def test_a_shared_prefix_draws_requests_while_the_queue_there_is_shorter_than_it() -> None:
    s = Scorer(2)
    c0 = s.choose(SYSTEM + user(0))
    t0 = s.started(c0, SYSTEM + user(0))
    # While the first prompt's 968 tokens prefill, joining it would wait 968 to save 768: 200 + 968 > 968.
    c1 = s.choose(SYSTEM + user(1))
    assert c1.engine != c0.engine
    s.started(c1, SYSTEM + user(1))
    # Once the first decodes, joining it costs 200 + 32 (the other engine: 200 + its own 968 prefill).
    s.prefilled(t0)
    assert s.choose(SYSTEM + user(2)).engine == c0.engine


def test_queued_prefill_is_weighed_against_the_tokens_a_hit_saves() -> None:
    s = Scorer(2)
    history = SYSTEM + user(4, 3328)  # 4096 tokens that engine 1 served and holds
    s.finished(s.started(Choice(1, 0, False), history), history)
    nxt = history + user(6)  # 4296 tokens: 200 to compute on engine 1, all of them on engine 0
    busy = s.started(Choice(1, 0, False), user(5, 3000))
    assert (s.queued_tokens(1), s.in_flight(1)) == (3000, 1)
    assert s.choose(nxt).engine == 1  # 200 + 3000 < 4296
    s.started(Choice(1, 0, False), user(7, 2000))
    assert s.choose(nxt).engine == 0  # 200 + 5000 > 4296
    s.prefilled(busy)  # decoding now: 32 instead of 3000 ahead
    assert s.queued_tokens(1) == 2032
    assert s.choose(nxt).engine == 1


def test_no_hit_anywhere_takes_the_least_loaded_engine() -> None:
    s = Scorer(3)
    s.started(Choice(0, 0, False), user(1))
    s.started(Choice(1, 0, False), user(2))
    c = s.choose(user(9))
    assert c == Choice(2, 0, False)


def test_the_index_hint_counts_where_the_router_has_no_memory() -> None:
    s = Scorer(2)
    c = s.choose(SYSTEM + user(1), {1: 512})
    assert (c.engine, c.expected_hit_tokens, c.scored) == (1, 512, True)
    # never more than the prompt, whatever the hint says
    assert s.choose(user(1, 64), {0: 4096}).expected_hit_tokens == 64


def test_memory_forgets_least_recently_used_blocks_first() -> None:
    m = PrefixMemory(capacity=4)
    a, b = block_keys(user(1, 96), 32), block_keys(user(2, 96), 32)
    m.add(a)
    m.add(b)
    assert len(m) == 4
    assert m.matched_blocks(b) == 3
    assert m.matched_blocks(a) == 0  # its head went first, so none of it counts any more


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError):
        Scorer(0)
    with pytest.raises(ValueError):
        Scorer(2, decode_tokens=-1)

"""kvprotocol.Pipeline against a real kvserver: requests in flight on one socket, answers taken when
they arrived, never a wait longer than asked, forgotten and fire-and-forget replies dropped, and
requests processed in the order they were sent."""

from __future__ import annotations

import os
import signal

import pytest

from kvtestkit.kvhelpers import register, sid, store, payload, tiny_layout
from kvprotocol import Pipeline, ServerError, pack_tokens
from kvprotocol import replies as rp
from kvprotocol import requests as rq

TOKENS = list(range(512))


def lookup_req(ks, tokens, session: str | None = None) -> rq.Lookup:
    return rq.Lookup(keyspace=ks.wire(), tokens=pack_tokens(tokens), session=sid(session) if session else None)


def test_answers_come_by_id_in_any_order(server) -> None:
    with server.client() as c:
        ks, _ = register(c)
        store(c, ks, TOKENS, lambda ch, g: payload(ch, tiny_layout().object_bytes))
    pipe = Pipeline(server.url)
    try:
        hit = pipe.submit(lookup_req(ks, TOKENS))
        miss = pipe.submit(lookup_req(ks, list(range(9000, 9600))))
        ping = pipe.submit(rq.Ping())
        assert pipe.in_flight == 3
        got_ping = pipe.result(ping, wait=5)
        got_miss = pipe.result(miss, wait=5)
        got_hit = pipe.result(hit, wait=5)
        assert got_ping is not None and isinstance(got_ping[0], rp.PingReply)
        assert got_miss is not None and got_miss[0].hit_tokens == 0
        assert got_hit is not None and got_hit[0].hit_tokens == 512
        assert pipe.in_flight == 0
        with pytest.raises(KeyError):  # taken already
            pipe.result(hit)
    finally:
        pipe.close()


def test_a_stalled_server_costs_no_more_than_the_wait_asked(server) -> None:
    """SIGSTOP the server: the answer is not there, result() returns None after its wait instead of
    blocking; once the server runs again the same id gets its answer."""
    with server.client() as c:
        ks, _ = register(c)
        store(c, ks, TOKENS, lambda ch, g: payload(ch, tiny_layout().object_bytes))
    pipe = Pipeline(server.url)
    assert server.proc is not None
    try:
        assert pipe.result(pipe.submit(rq.Ping()), wait=5) is not None  # connected
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            rid = pipe.submit(lookup_req(ks, TOKENS))
            assert pipe.result(rid, wait=0) is None
            assert pipe.result(rid, wait=0.05) is None
            polls = 0
            drain = pipe._drain

            def counted(timeout: float) -> int:
                nonlocal polls
                polls += 1
                return drain(timeout)

            pipe._drain = counted  # type: ignore[method-assign]
            assert pipe.result(rid, wait=0.0009) is None
            assert polls <= 3  # a wait under a millisecond sleeps in one poll, it does not spin
            pipe._drain = drain  # type: ignore[method-assign]
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        got = pipe.result(rid, wait=5)
        assert got is not None and got[0].hit_tokens == 512
    finally:
        pipe.close()


def test_forgotten_and_fire_and_forget_replies_are_dropped(server) -> None:
    pipe = Pipeline(server.url)
    try:
        gone = pipe.submit(rq.Ping())
        pipe.forget(gone)
        pipe.submit(rq.Ping(), want_reply=False)
        last = pipe.submit(rq.Ping())
        assert pipe.result(last, wait=5) is not None  # the two earlier replies arrived before it
        assert pipe.in_flight == 0
        with pytest.raises(KeyError):
            pipe.result(gone)
    finally:
        pipe.close()


def test_an_error_reply_raises_and_the_pipeline_keeps_working(server) -> None:
    pipe = Pipeline(server.url)
    try:
        bad = pipe.submit(rq.Retrieve(session=sid("never"), rank=0, start_chunk=0, end_chunk=1))
        with pytest.raises(ServerError) as err:
            pipe.result(bad, wait=5)
        assert err.value.code == "UNKNOWN_SESSION"
        assert pipe.result(pipe.submit(rq.Ping()), wait=5) is not None
    finally:
        pipe.close()


def test_a_release_sent_before_a_lookup_is_processed_before_it(server) -> None:
    """Order on one pipeline: lookup (leases), release (fire and forget), lookup again (leases anew).
    Processed out of order, the release would drop the second lookup's leases."""
    with server.client() as c:
        ks, _ = register(c)
        store(c, ks, TOKENS, lambda ch, g: payload(ch, tiny_layout().object_bytes))
        pipe = Pipeline(server.url)
        try:
            first = pipe.submit(lookup_req(ks, TOKENS, "s"))
            pipe.submit(rq.Release(session=sid("s")), want_reply=False)
            second = pipe.submit(lookup_req(ks, TOKENS, "s"))
            for rid in (first, second):
                got = pipe.result(rid, wait=5)
                assert got is not None and got[0].hit_tokens == 512
            assert c.call("describe").result["l1"]["leased"] == 2  # the second lookup's
        finally:
            pipe.close()

"""Bystander pings while tenant mallory attacks reservations and the session-object budget.

Starts a real kvserver with tenants alice and mallory (the real CLI, a temporary state directory),
then alternates rounds: in "attack" rounds a thread runs mallory's attacks (a reservation of all of
L1, one of her whole cap kept up by empty stores, and sessions of 65536-chunk missed lookups with
`rank`); in "quiet" rounds it does nothing. A bystander sends `ping` throughout; per condition it
prints the ping median and range and the ratio. After the run it checks that alice can still store a
whole request and read it through a session (harness: bystander.py).
Run: `uv run python -m bench.isolation.resv_pings`.
"""

from __future__ import annotations

import secrets
import tempfile
import threading
from pathlib import Path

from bench.isolation.bystander import LAYOUT, Server, alternate, report, register
from kvtestkit.tenants import add_tenant
from kvprotocol import Client, KeySpace, ServerError, pack_tokens
from kvprotocol import requests as rq

OBJ = LAYOUT.object_bytes


def book(c: Client, ks: KeySpace, rid: str, total: int) -> str:
    """A reservation's first store that writes nothing: it only books `total` chunks."""
    try:
        c.send(rq.Store(keyspace=ks.wire(), tokens=b"", rank=0, reservation=rid, total_chunks=total, mode="tcp"))
        return "admitted"
    except ServerError as exc:
        return str(exc.code)


def attack(mallory: Client, ks: KeySpace, capacity: int, cap: int, stop: threading.Event, seen: dict) -> None:
    miss = pack_tokens(list(range(1 << 16)))
    keep = "r-keep-" + secrets.token_hex(8)
    i = 0
    while not stop.is_set():
        i += 1
        for outcome in (book(mallory, ks, f"r-all-{i:016d}", capacity // OBJ), book(mallory, ks, keep, cap // OBJ)):
            seen[outcome] = seen.get(outcome, 0) + 1
        session = f"m-{i % 64:020d}"
        try:
            mallory.call("lookup", keyspace=ks.to_wire(), tokens=miss, session=session, rank=0)
            seen["miss sessions"] = seen.get("miss sessions", 0) + 1
        except ServerError as exc:
            seen[str(exc.code)] = seen.get(str(exc.code), 0) + 1


def alice_whole_request(alice: Client, ks: KeySpace) -> bool:
    """Store four chunks as one reservation (tcp), then read them whole through a session."""
    from kvtestkit.kvhelpers import payload, retrieve, store

    tokens = list(range(900_000, 900_000 + 4 * 256))
    store(alice, ks, tokens, lambda ch, g: payload(ch, OBJ), reservation="a-" + secrets.token_hex(12), total_chunks=4)
    session = "a-" + secrets.token_hex(12)
    hit = alice.call("lookup", keyspace=ks.to_wire(), tokens=pack_tokens(tokens), session=session).result
    got = retrieve(alice, session, 0, 4)
    alice.call("release", session=session)
    return bool(hit["hit_chunks"] == 4 and all(got[(c, 0)] == payload(c, OBJ) for c in range(4)))


def main() -> None:

    with tempfile.TemporaryDirectory() as tmp:
        tenants = Path(tmp) / "tenants.json"
        alice_tok, mallory_tok = add_tenant(tenants, "alice"), add_tenant(tenants, "mallory")
        srv = Server(Path(tmp), tenants, "--l1-size-gb", "0.05", "--lease-ttl", "1")
        try:
            pinger = srv.client(alice_tok)  # waits until the server answers (its token file is written)
            admin = srv.admin()
            ks = register(admin)
            alice, mallory = Client(srv.url, token=alice_tok), Client(srv.url, token=mallory_tok)
            d = admin.call("describe").result
            capacity, cap = d["l1"]["capacity_bytes"], d["tenants"]["mallory"]["max_reserved_bytes"]
            seen: dict[str, int] = {}
            times = alternate(pinger, lambda stop: attack(mallory, ks, capacity, cap, stop, seen))
            report("reservations + session objects", times)
            print("mallory's outcomes:", dict(sorted(seen.items())))
            row = admin.call("describe").result["tenants"]["mallory"]
            print(f"mallory holds {row['session_objects']} session objects, books {row['reserved_bytes']} bytes")
            print("alice stores and reads a whole request after the attack:", alice_whole_request(alice, ks))
            for c in (pinger, alice, mallory, admin):
                c.close()
        finally:
            srv.stop()


if __name__ == "__main__":
    main()

"""Bystander pings while a tenant loops shm store-then-abort past its quota (#34 finding 5).

Starts a real kvserver with tenants alice and carol (carol: `--allow-shm`, a 3-object L1 quota),
then alternates rounds: in "attack" rounds a thread has carol reserve a new object in shm mode and
abort it, again and again (aborted shm slots are quarantined, since the writer may still be
copying, and stay charged to her until freed); in "quiet" rounds it does nothing. A bystander pings
throughout; per condition it prints the ping median and range and the ratio. After the run it
checks that carol's charged bytes stayed within her quota, the quarantine held no more, and alice
still stores (harness: bystander.py). Run: `uv run python -m bench.isolation.quota_pings`.
"""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path

from bench.isolation.bystander import LAYOUT, Server, alternate, report, register
from kvtestkit.tenants import add_tenant
from kvprotocol import Client, KeySpace, ServerError, pack_tokens

OBJ = LAYOUT.object_bytes
C = 256


def attack(carol: Client, ks: KeySpace, stop: threading.Event, seen: dict[str, int]) -> None:
    i = 0
    while not stop.is_set():
        i += 1
        tokens = pack_tokens(list(range(i * C, (i + 1) * C)))  # a new key each time
        try:
            r = carol.call("store", keyspace=ks.to_wire(), tokens=tokens, rank=0, mode="shm").result
        except ServerError as exc:
            seen[str(exc.code)] = seen.get(str(exc.code), 0) + 1
            continue
        for s in r["slots"]:
            seen[s["status"]] = seen.get(s["status"], 0) + 1
        if r["store_id"]:
            carol.call("abort", store_id=r["store_id"])


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tenants = Path(tmp) / "tenants.json"
        alice_tok = add_tenant(tenants, "alice")
        carol_tok = add_tenant(tenants, "carol", "--allow-shm", "--l1-quota-gb", str(3 * OBJ / (1 << 30)))
        srv = Server(Path(tmp), tenants, "--l1-size-gb", "0.05", "--lease-ttl", "2")
        try:
            pinger = srv.client(alice_tok)
            admin = srv.admin()
            ks = register(admin)
            alice, carol = Client(srv.url, token=alice_tok), Client(srv.url, token=carol_tok)
            seen: dict[str, int] = {}
            times = alternate(pinger, lambda stop: attack(carol, ks, stop, seen))
            report("quarantine quota", times)
            print("carol's outcomes:", dict(sorted(seen.items())))
            d = admin.call("describe").result
            row = d["tenants"]["carol"]
            print(
                f"carol: l1_used_bytes={row['l1_used_bytes']} (quota {row['l1_quota_bytes']}); "
                f"quarantined_bytes={d['l1']['quarantined_bytes']}; L1 capacity {d['l1']['capacity_bytes']}"
            )
            toks = pack_tokens(list(range(10_000_000, 10_000_000 + 2 * C)))
            r = alice.call("store", keyspace=ks.to_wire(), tokens=toks, rank=0, mode="tcp").result
            print("alice still reserves both chunks:", [s["status"] for s in r["slots"]] == ["reserved"] * 2)
            for c in (pinger, alice, carol, admin):
                c.close()
        finally:
            srv.stop()


if __name__ == "__main__":
    main()

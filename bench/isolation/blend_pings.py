"""Bystander pings while tenant mallory attacks through CacheBlend (#34 finding 4).

Starts a real kvserver with tenants alice and mallory (mallory: a 64 KiB L1 quota, 2 stores in
flight, 16 sessions), then alternates rounds: in "attack" rounds a thread runs mallory's attacks
(blend stores of many chunks that are never committed, and blend lookups that each open a new
session); in "quiet" rounds it does nothing. A bystander pings throughout; per condition it prints
the ping median and range and the ratio. After the run it checks mallory's usage stayed within her
limits and that alice still blend-stores and finds her document (harness: bystander.py).
Run: `uv run python -m bench.isolation.blend_pings`.
"""

from __future__ import annotations

import secrets
import tempfile
import threading
from pathlib import Path

from bench.isolation.bystander import LAYOUT, Server, alternate, report, register
from kvtestkit.tenants import add_tenant
from kvprotocol import Client, KeySpace, ServerError, pack_tokens
from kvprotocol.kvsum import kvsum64

OBJ = LAYOUT.object_bytes
C = 256


def blend_store(c: Client, ks: KeySpace, doc: list[int], commit: bool) -> dict:
    r = c.call("blend_store", keyspace=ks.to_wire(), tokens=pack_tokens(doc), rank=0, mode="tcp").result
    reserved = [s for s in r["slots"] if s["status"] == "reserved"]
    if commit and r["store_id"]:
        frames = [bytes([s["chunk"] % 251]) * OBJ for s in reserved]
        c.call("commit", frames=frames, store_id=r["store_id"], checksums=[kvsum64(f) for f in frames])
    return r


def attack(mallory: Client, ks: KeySpace, stop: threading.Event, seen: dict[str, int]) -> None:
    i = 0
    while not stop.is_set():
        i += 1
        doc = list(range(i * 64 * C, (i + 1) * 64 * C))  # 64 chunks, never committed
        try:
            r = blend_store(mallory, ks, doc, commit=False)
            for s in r["slots"]:
                seen[s["status"]] = seen.get(s["status"], 0) + 1
        except ServerError as exc:
            seen[str(exc.code)] = seen.get(str(exc.code), 0) + 1
        try:
            mallory.call(
                "blend_lookup",
                keyspace=ks.to_wire(),
                tokens=pack_tokens(doc),
                starts=[0],
                session=secrets.token_hex(12),
            )
            seen["sessions"] = seen.get("sessions", 0) + 1
        except ServerError as exc:
            seen["lookup " + str(exc.code)] = seen.get("lookup " + str(exc.code), 0) + 1


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tenants = Path(tmp) / "tenants.json"
        alice_tok = add_tenant(tenants, "alice")
        quota = str(4 * OBJ / (1 << 30))
        mallory_tok = add_tenant(
            tenants, "mallory", "--l1-quota-gb", quota, "--max-stores", "2", "--max-sessions", "16"
        )
        srv = Server(Path(tmp), tenants, "--l1-size-gb", "0.05", "--lease-ttl", "2")
        try:
            pinger = srv.client(alice_tok)
            admin = srv.admin()
            ks = register(admin)
            alice, mallory = Client(srv.url, token=alice_tok), Client(srv.url, token=mallory_tok)
            seen: dict[str, int] = {}
            times = alternate(pinger, lambda stop: attack(mallory, ks, stop, seen))
            report("blend", times)
            print("mallory's outcomes:", dict(sorted(seen.items())))
            d = admin.call("describe").result
            row = d["tenants"]["mallory"]
            print(
                f"mallory: l1_used_bytes={row['l1_used_bytes']} (quota {row['l1_quota_bytes']}), "
                f"sessions={row['sessions']} (cap 16), stores_in_flight={row['stores_in_flight']} (cap 2); "
                f"L1 used {d['l1']['used_bytes']} of {d['l1']['capacity_bytes']}"
            )
            doc = list(range(10_000_000, 10_000_000 + 4 * C))
            stored = blend_store(alice, ks, doc, commit=True)
            found = alice.call("blend_lookup", keyspace=ks.to_wire(), tokens=pack_tokens(doc), starts=[0]).result
            ok = [s["status"] for s in stored["slots"]] == ["reserved"] * 4 and len(found["matches"]) == 4
            print("alice blend-stores and finds her document after the attack:", ok)
            for c in (pinger, alice, mallory, admin):
                c.close()
        finally:
            srv.stop()


if __name__ == "__main__":
    main()

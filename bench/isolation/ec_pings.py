"""Bystander pings while tenant bob attacks the encoder cache (quota churn, lease and store exhaustion).

Starts a real kvserver with tenants alice and bob (the real CLI, a temporary state directory), then
alternates rounds: in "attack" rounds a thread runs bob's attack (stores through his 1 MiB EC
quota, leasing past his cap, opening stores past his cap); in "quiet" rounds it does nothing. A
bystander sends `ping` throughout; per condition it prints the ping median and range and the ratio.
After the run it checks that alice's item is still intact (harness: bystander.py).
Run: `uv run python -m bench.isolation.ec_pings`.
"""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path

from bench.isolation.bystander import Server, alternate, report
from kvtestkit.tenants import add_tenant
from kvprotocol import Client, ServerError
from kvprotocol.kvsum import kvsum64

KEY = {"model": "tiny-vlm@0123456789abcdef", "space": "fedcba9876543210"}
MiB = 1 << 20


def put(c: Client, item: str, data: bytes) -> str:
    r = c.call("ec_store", **KEY, item=item, dtype="uint8", shape=[len(data)], size=len(data), mode="tcp").result
    if r["status"] == "reserved":
        c.call("ec_commit", [data], store_id=r["store_id"], checksum=kvsum64(data))
    return str(r["status"])


def attack(bob: Client, stop: threading.Event, ops: list[int]) -> None:
    i = 0
    blob = os.urandom(MiB // 4)
    while not stop.is_set():
        i += 1
        try:
            put(bob, f"b-{i}", blob)  # churns through his own quota only
            bob.call("ec_lookup", **KEY, items=[f"b-{i}"] * 64, readers=1)  # past his lease cap: nulls
            bob.call("ec_store", **KEY, item=f"open-{i}", dtype="uint8", shape=[64], size=64, mode="tcp")
        except ServerError:
            pass  # TOO_MANY once his store cap is reached
        ops[0] += 1


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tenants = Path(tmp) / "tenants.json"
        alice_tok = add_tenant(tenants, "alice")
        bob_tok = add_tenant(
            tenants, "bob", "--ec-quota-gb", str(MiB / (1 << 30)), "--ec-max-stores", "8", "--ec-max-leases", "8"
        )
        flags = ["--l1-size-gb", "0.02", "--ec-size-gb", str(8 * MiB / (1 << 30)), "--lease-ttl", "2"]
        srv = Server(Path(tmp), tenants, *flags)
        try:
            pinger = srv.client(alice_tok)
            alice, bob = Client(srv.url, token=alice_tok), Client(srv.url, token=bob_tok)
            mine = os.urandom(MiB)
            put(alice, "a-keep", mine)
            ops = [0]
            times = alternate(pinger, lambda stop: attack(bob, stop, ops))
            report("ec", times)
            print(f"attack iterations (store + lease + open): {ops[0]}")
            r = alice.call("ec_retrieve", **KEY, item="a-keep", mode="tcp")
            print("alice's item intact after the attack:", r.result["found"] and bytes(r.frames[0]) == mine)
            for c in (pinger, alice, bob):
                c.close()
        finally:
            srv.stop()


if __name__ == "__main__":
    main()

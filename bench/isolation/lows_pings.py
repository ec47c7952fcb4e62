"""Bystander pings while tenant mallory floods registrations and a token-less reader polls status.

Starts a real kvserver with tenants alice and mallory (the real CLI, a temporary state directory),
then alternates rounds: in "attack" rounds threads run mallory's registrations (new layouts past her
cap, then engines past her share of the engine table) and an anonymous reader polling /v1/status
and /metrics; in "quiet" rounds nothing. A bystander (alice) sends `ping` throughout; per condition
it prints the ping median and range and the ratio. Afterwards it checks that alice's engine is still
registered, that she can register and store, and that the anonymous reader saw no tenant name.
(The arena squatting finding stops a start, so it has no rounds here.) Harness: bystander.py.
Run: `uv run python -m bench.isolation.lows_pings`.
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import urllib.request
from pathlib import Path

from bench.isolation.bystander import Server, alternate, report
from kvtestkit.tenants import add_tenant
from kvprotocol import Client, LayoutDescriptor, ServerError


def layout(layers: int) -> LayoutDescriptor:
    return LayoutDescriptor("vllm_cpu", "float32", layers, 32, 1024, 256, (256,))


def register(c: Client, layers: list[int], **extra: object) -> dict:
    groups = [layout(n).to_wire() for n in layers]
    return dict(c.call("register_engine", model="m", world_size=1, rank=0, groups=groups, **extra).result)


def flood(mallory: Client, stop: threading.Event, ops: list[int]) -> None:
    n = 10
    while not stop.is_set():
        try:
            register(mallory, list(range(n, n + 64)))  # new layouts: TOO_MANY once she holds 256
        except ServerError:
            ops[1] += 1
        n = 10 if n > 800 else n + 64  # layer counts stay valid; the fingerprints repeat after a while
        register(mallory, [2])  # another engine: pushes out only her own oldest
        ops[0] += 2


def reader(url: str, stop: threading.Event, seen: list[str]) -> None:
    while not stop.is_set():
        for path in ("/v1/status", "/metrics"):
            with urllib.request.urlopen(url + path, timeout=5) as resp:  # no token
                seen.append(resp.read().decode())
        del seen[:-4]


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tenants = Path(tmp) / "tenants.json"
        alice_tok, mallory_tok = add_tenant(tenants, "alice"), add_tenant(tenants, "mallory")
        srv = Server(Path(tmp), tenants, "--l1-size-gb", "0.02", "--lease-ttl", "2")
        try:
            pinger = srv.client(alice_tok)
            alice, mallory = Client(srv.url, token=alice_tok), Client(srv.url, token=mallory_tok)
            mine = register(alice, [2], host=socket.gethostname(), pid=os.getpid())["engine_id"]
            ops, seen = [0, 0], [""]
            http = f"http://127.0.0.1:{srv.http_port}"

            def attack(stop: threading.Event) -> None:
                t = threading.Thread(target=reader, args=(http, stop, seen))
                t.start()
                flood(mallory, stop, ops)
                t.join()

            times = alternate(pinger, attack)
            report("lows", times)
            print(f"mallory registrations: {ops[0]} ({ops[1]} refused TOO_MANY)")
            admin = srv.admin()
            engines = admin.call("describe").result["engines"]
            print("alice's engine still registered:", any(e["id"] == mine for e in engines))
            print("mallory's engine entries:", sum(e["tenant"] == "mallory" for e in engines))
            print("alice registers a new layout:", bool(register(alice, [3])["engine_id"]))
            print("anonymous reader saw a tenant name:", any("mallory" in s or "alice" in s for s in seen))
            for c in (pinger, alice, mallory, admin):
                c.close()
        finally:
            srv.stop()


if __name__ == "__main__":
    main()

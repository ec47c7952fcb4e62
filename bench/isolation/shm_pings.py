"""Bystander pings while tenant bob tries shm mode (#34 finding 10) and while silent connections
pile up on both ports (#34 finding 11).

Starts a real kvserver (the real CLI, a temporary state directory, --idle-timeout 1) with tenants
alice (--allow-shm) and bob, then alternates quiet and attack rounds for each attack (harness:
bystander.py). "shm": bob asks for shm stores (refused, FORBIDDEN) and stores over tcp instead.
"conns": 200 connections per round that never send a request, half to the ZMQ port, half to the
HTTP port (half of those with an unfinished request head), held open by the attacker. Prints the
ping figures, the refusals, and the server's descriptor count at its peak and after the attack.
Run: `uv run python -m bench.isolation.shm_pings`.
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import time
from pathlib import Path

from bench.isolation.bystander import Server, alternate, report
from kvtestkit.tenants import add_tenant
from kvprotocol import Client, LayoutDescriptor, ServerError, pack_tokens
from kvprotocol.kvsum import kvsum64


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def shm_attack(bob: Client, ks: dict, stop: threading.Event, refused: list[int]) -> None:
    i = 0
    while not stop.is_set():
        i += 1
        tokens = pack_tokens(range(i * 256, (i + 1) * 256))
        try:
            bob.call("store", keyspace=ks, tokens=tokens, rank=0, mode="shm")
        except ServerError as exc:
            refused[0] += str(exc.code) == "FORBIDDEN"
        r = bob.call("store", keyspace=ks, tokens=tokens, rank=0, mode="tcp").result
        if r.get("store_id"):
            data = [os.urandom(s["size"]) for s in r["slots"] if s["status"] == "reserved"]
            bob.call("commit", data, store_id=r["store_id"], checksums=[kvsum64(d) for d in data])


def conn_attack(srv: Server, stop: threading.Event, held: list[socket.socket], peak: list[int]) -> None:
    for i in range(100):
        for port in (srv.port, srv.http_port):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            if port == srv.http_port and i % 2:
                s.sendall(b"GET /v1/status HTTP/1.1\r\nHost: x\r\n")
            held.append(s)
    while not stop.is_set():
        peak[0] = max(peak[0], fds(srv.proc.pid))
        time.sleep(0.02)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tenants = Path(tmp) / "tenants.json"
        alice_tok = add_tenant(tenants, "alice", "--allow-shm")
        bob_tok = add_tenant(tenants, "bob")
        srv = Server(Path(tmp), tenants, "--l1-size-gb", "0.05", "--idle-timeout", "1")
        try:
            pinger = srv.client(alice_tok)
            bob = Client(srv.url, token=bob_tok)
            layout = LayoutDescriptor("vllm_cpu", "float32", 2, 32, 1024, 256, (256,)).to_wire()
            reg = bob.call("register_engine", model="m", world_size=1, rank=0, groups=[layout]).result
            print("bob's registration names arena:", reg["arena"])
            ks = {"model": "m", "world_size": 1, "groups": reg["groups"]}
            refused = [0]
            report("shm", alternate(pinger, lambda stop: shm_attack(bob, ks, stop, refused)))
            print(f"shm: bob's shm stores refused (FORBIDDEN): {refused[0]}")
            before = fds(srv.proc.pid)
            held: list[socket.socket] = []
            peak = [before]
            report("conns", alternate(pinger, lambda stop: conn_attack(srv, stop, held, peak)))
            deadline = time.monotonic() + 10
            while fds(srv.proc.pid) > before + 4 and time.monotonic() < deadline:
                time.sleep(0.1)
            print(
                f"conns: {len(held)} silent connections opened; server fds {before} before, "
                f"peak {peak[0]}, {fds(srv.proc.pid)} after the idle timeout"
            )
            for s in held:
                s.close()
            print("bystander still answers after the attack:", bool(pinger.ping()))
            for c in (pinger, bob):
                c.close()
        finally:
            srv.stop()


if __name__ == "__main__":
    main()

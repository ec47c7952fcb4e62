"""Bystander pings while tenant bob attacks the encoder cache (quota churn, lease and store exhaustion).

Starts a real kvserver with tenants alice and bob (the real CLI, a temporary state directory), then
alternates rounds: in "attack" rounds a thread runs bob's attack (stores through his 1 MiB EC
quota, leasing past his cap, opening stores past his cap); in "quiet" rounds it does nothing. A
bystander sends `ping` throughout; per condition it prints the ping median and range and the ratio.
After the run it checks that alice's item is still intact. Run: `uv run python bench/isolation/ec_pings.py`.
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from kvprotocol import Client, ServerError
from kvprotocol.kvsum import kvsum64

BIN = Path(sys.executable).parent
KEY = {"model": "tiny-vlm@0123456789abcdef", "space": "fedcba9876543210"}
MiB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def add_tenant(tenants: Path, name: str, *flags: str) -> str:
    return subprocess.run(
        [str(BIN / "kvserver"), "tenant", "add", name, "--tenants-file", str(tenants), *flags],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


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
        port = free_port()
        env = {**os.environ, "KVSERVER_STATE_DIR": tmp}
        proc = subprocess.Popen(
            [
                str(BIN / "kvserver"),
                "start",
                "--port",
                str(port),
                "--l1-size-gb",
                "0.02",
                "--ec-size-gb",
                str(8 * MiB / (1 << 30)),
                "--http-port",
                "0",
                "--lease-ttl",
                "2",
                "--tenants-file",
                str(tenants),
                "--log-level",
                "warning",
            ],
            stdout=subprocess.DEVNULL,
            env=env,
        )
        url = f"tcp://127.0.0.1:{port}"
        try:
            pinger = Client(url, timeout=2.0, token=alice_tok)
            for _ in range(200):
                try:
                    pinger.ping()
                    break
                except Exception:
                    time.sleep(0.1)
            alice, bob = Client(url, token=alice_tok), Client(url, token=bob_tok)
            mine = os.urandom(MiB)
            put(alice, "a-keep", mine)
            times: dict[str, list[float]] = {"quiet": [], "attack": []}
            ops = [0]
            for _ in range(6):
                for cond in ("quiet", "attack"):
                    stop = threading.Event()
                    t = threading.Thread(target=attack, args=(bob, stop, ops)) if cond == "attack" else None
                    if t is not None:
                        t.start()
                    end = time.monotonic() + 0.5
                    while time.monotonic() < end:
                        t0 = time.perf_counter()
                        pinger.ping()
                        times[cond].append((time.perf_counter() - t0) * 1e3)
                    stop.set()
                    if t is not None:
                        t.join()
            for cond, v in times.items():
                print(
                    f"{cond:7s} pings={len(v):5d} median={statistics.median(v):.3f} ms "
                    f"range=[{min(v):.3f}, {max(v):.3f}] ms"
                )
            print(f"attack iterations (store + lease + open): {ops[0]}")
            ratio = statistics.median(times["attack"]) / statistics.median(times["quiet"])
            print(f"ratio attack/quiet median: {ratio:.2f}")
            r = alice.call("ec_retrieve", **KEY, item="a-keep", mode="tcp")
            print("alice's item intact after the attack:", r.result["found"] and bytes(r.frames[0]) == mine)
            for c in (pinger, alice, bob):
                c.close()
        finally:
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    main()

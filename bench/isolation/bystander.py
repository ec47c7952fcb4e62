"""Shared harness of the isolation benches: a real kvserver with tenants, and bystander pings.

Each `*_pings.py` script starts a server with `Server`, makes tenants with the real CLI
(`add_tenant`), and hands `alternate` an attack: a function that runs until its stop event is set.
`alternate` runs quiet and attack rounds in turn while a bystander pings, and `report` prints the
ping median and range per condition and their ratio (one sitting: indicative, not a result).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kvprotocol import Client, KeySpace, LayoutDescriptor
from kvtestkit.ports import free_port

BIN = Path(sys.executable).parent
LAYOUT = LayoutDescriptor("vllm_cpu", "float32", 2, 32, 1024, 256, (256,))  # a small engine layout
Attack = Callable[[threading.Event], None]


class Server:
    """`kvserver start` on a free loopback port with the given state dir, tenants file and flags."""

    def __init__(self, state_dir: Path, tenants: Path | None, *flags: str) -> None:
        self.state_dir = state_dir
        self.port = free_port()
        self.http_port = free_port()
        self.url = f"tcp://127.0.0.1:{self.port}"
        args = [str(BIN / "kvserver"), "start", "--port", str(self.port), "--http-port", str(self.http_port)]
        if tenants is not None:
            args += ["--tenants-file", str(tenants)]
        env = {**os.environ, "KVSERVER_STATE_DIR": str(state_dir)}
        self.proc = subprocess.Popen([*args, "--log-level", "warning", *flags], stdout=subprocess.DEVNULL, env=env)

    def client(self, token: str | None, timeout: float = 2.0) -> Client:
        """A client, once the server answers a ping."""
        c = Client(self.url, timeout=timeout, token=token)
        deadline = time.monotonic() + 20
        while True:
            try:
                c.ping()
                return c
            except Exception:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise
                time.sleep(0.1)

    def admin(self) -> Client:
        """A client with the server's own token (from its default file), once the server answers."""
        return self.client((self.state_dir / f"token-{self.port}").read_text().strip())

    def stop(self) -> None:
        """Stop the server and remove the arena it leaves for a warm restart (a bench keeps nothing)."""
        self.proc.terminate()
        self.proc.wait(10)
        for suffix in ("", ".journal", "-ec", "-ec.journal"):
            Path(f"/dev/shm/kvserver-{self.port}{suffix}").unlink(missing_ok=True)


def alternate(pinger: Client, attack: Attack, rounds: int = 6, seconds: float = 0.5) -> dict[str, list[float]]:
    """Ping latencies (ms) per condition over alternating quiet and attack rounds."""
    times: dict[str, list[float]] = {"quiet": [], "attack": []}
    for _ in range(rounds):
        for cond in ("quiet", "attack"):
            stop = threading.Event()
            t = threading.Thread(target=attack, args=(stop,)) if cond == "attack" else None
            if t is not None:
                t.start()
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                t0 = time.perf_counter()
                pinger.ping()
                times[cond].append((time.perf_counter() - t0) * 1e3)
            stop.set()
            if t is not None:
                t.join()
    return times


def report(name: str, times: dict[str, list[float]]) -> float:
    """Print median and range per condition; return the attack/quiet ratio of medians."""
    for cond, v in times.items():
        print(
            f"{name}: {cond:7s} pings={len(v):5d} median={statistics.median(v):.3f} ms "
            f"range=[{min(v):.3f}, {max(v):.3f}] ms"
        )
    ratio = statistics.median(times["attack"]) / statistics.median(times["quiet"])
    print(f"{name}: ratio attack/quiet median {ratio:.2f}")
    return ratio


def register(admin: Client, layout: LayoutDescriptor = LAYOUT) -> KeySpace:
    """Register an engine of model "m" (one rank) with `layout`; the keyspace its objects use."""
    admin.call("register_engine", model="m", world_size=1, rank=0, groups=[layout.to_wire()])
    return KeySpace.from_layouts("m", 1, [layout])

"""Warm restart of a full arena: how long until a `kill -9`ed server is ready again, and until every
adopted object is verified (servable).

A real `kvserver start` with an L1 of `--gb` GiB is filled through the shared-memory path with
objects of `--object-mb` MiB (what an engine does), killed with SIGKILL, and started again on the
same port `--rounds` times, alternating with the restart of an empty server of the same size
(`--cold`, the baseline: what a start costs without adoption). Each round reports the seconds from
spawn to the first answered ping (ready: new stores are taken, adopted objects stay invisible until
verified), the server's own verify time (`describe`'s `warm_restart.verify_s`), and the adopted and
verified counts. One fill serves every round (each restart adopts what the previous one verified).
Medians and ranges over the rounds; a figure of this machine and sitting, not a promise.

    uv run python -m bench.warm_restart                 # 4 GiB, 4 MiB objects, 3 rounds
    uv run python -m bench.warm_restart --gb 16 --json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kvprotocol import Client, LayoutDescriptor
from kvtestkit.kvhelpers import ArenaMap, lookup, register, store
from kvtestkit.ports import free_port

BIN = Path(sys.executable).parent
MIB = 1 << 20
CHUNK = 256


class Server:
    """`kvserver start` on one port, started and killed again and again (its arena stays between)."""

    def __init__(self, gb: float, state: Path, *flags: str) -> None:
        self.port, self.state = free_port(), state
        self.prefix = f"kvtest{self.port}"  # removed by the test suite's dead-arena sweep if left
        self.args = [str(BIN / "kvserver"), "start", "--port", str(self.port), "--http-port", "0"]
        self.args += [
            "--l1-size-gb",
            str(gb),
            "--ec-size-gb",
            "0.01",
            "--shm-prefix",
            self.prefix,
            "--lease-ttl",
            "60",
            *flags,
        ]
        self.env = {**os.environ, "KVSERVER_STATE_DIR": str(state)}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> float:
        """Spawn and wait for the first answered ping; seconds from spawn."""
        t0 = time.perf_counter()
        self.proc = subprocess.Popen([*self.args, "--log-level", "warning"], stdout=subprocess.DEVNULL, env=self.env)
        with Client(f"tcp://127.0.0.1:{self.port}", timeout=0.2) as c:
            while True:
                try:
                    c.ping()
                    return time.perf_counter() - t0
                except Exception:
                    if self.proc.poll() is not None:
                        raise RuntimeError(f"kvserver exited with {self.proc.returncode}") from None
                    time.sleep(0.005)

    def admin(self, timeout: float = 30.0) -> Client:
        token = (self.state / f"token-{self.port}").read_text().strip()
        return Client(f"tcp://127.0.0.1:{self.port}", timeout=timeout, token=token)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def remove(self) -> None:
        self.kill()
        for suffix in ("", ".journal", "-ec", "-ec.journal", ".lock"):
            Path(f"/dev/shm/{self.prefix}-{self.port}{suffix}").unlink(missing_ok=True)


def _layout(object_mb: int) -> LayoutDescriptor:
    return LayoutDescriptor("vllm_cpu", "float32", 1, 16, object_mb * MIB // (CHUNK // 16), CHUNK, (1024,))


def prompt_tokens(prompt: int) -> range:
    return range(prompt, prompt + 8 * CHUNK)


def fill(server: Server, gb: float, object_mb: int, acked: list[int] | None = None) -> int:
    """Store 8-chunk prompts through the arena until it is nearly full; objects committed. With
    `acked`, each prompt whose commit was answered is appended to it, and a server gone mid-way
    (killed) ends the fill instead of failing it."""
    layout = _layout(object_mb)
    blob = bytearray(os.urandom(layout.object_bytes))
    stored = 0

    def data(_chunk: int, _group: int) -> bytes:
        nonlocal stored
        blob[:8] = stored.to_bytes(8, "little")  # every object's bytes differ
        stored += 1
        return bytes(blob)

    prompts = int(gb * (1 << 30)) // layout.object_bytes // 8 - 1  # all but one prompt's room: no eviction
    with server.admin(timeout=2.0) as c:
        ks, reply = register(c, layouts=[layout])
        arena = ArenaMap(reply["arena"]["name"], reply["arena"]["size"])
        try:
            for prompt in range(prompts):
                try:
                    store(c, ks, prompt_tokens(prompt), data, mode="shm", arena=arena)
                except Exception:
                    if acked is None:
                        raise
                    return len(acked) * 8  # the server was killed under us
                if acked is not None:
                    acked.append(prompt)
                if prompt % 64 == 0:
                    print(f"  filled {stored * object_mb} MiB", file=sys.stderr, end="\r")
        finally:
            arena.close()
        return int(c.call("describe").result["l1"]["objects"])


def kill_under_load(server: Server, gb: float, object_mb: int, after_s: float) -> dict[str, Any]:
    """Kill the server with SIGKILL while a client stores as fast as it can, start it again, and
    count the prompts whose commit was answered before the kill that are whole hits afterwards."""
    acked: list[int] = []
    writer = threading.Thread(target=fill, args=(server, gb, object_mb, acked), daemon=True)
    writer.start()
    time.sleep(after_s)
    server.kill()
    writer.join(30)
    acknowledged = list(acked)
    ready_s = server.start()
    with server.admin() as c:
        while (warm := c.call("describe").result["warm_restart"])["pending"]:
            time.sleep(0.05)
        ks, _ = register(c, layouts=[_layout(object_mb)])
        whole = sum(lookup(c, ks, list(prompt_tokens(p))) == 8 * CHUNK for p in acknowledged)
    return {
        "acknowledged_prompts": len(acknowledged),
        "whole_after_restart": whole,
        "adopted_share": whole / len(acknowledged) if acknowledged else None,
        "adopted_objects": warm["adopted"],
        "rejected_objects": warm["rejected"],
        "ready_s": ready_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=4.0, help="L1 size (GiB)")
    ap.add_argument("--object-mb", type=int, default=4, help="size of one object (MiB)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--empty-gb", type=float, help="L1 size of the empty baseline server (default --gb; /dev/shm must hold both)"
    )
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--kill-under-load",
        type=float,
        metavar="S",
        help="instead: kill -9 the server S seconds into a store stream, restart, count the acknowledged prompts kept",
    )
    a = ap.parse_args()
    if a.kill_under_load is not None:
        with tempfile.TemporaryDirectory() as state:
            server = Server(a.gb, Path(state))
            try:
                server.start()
                res = kill_under_load(server, a.gb, a.object_mb, a.kill_under_load)
            finally:
                server.remove()
        print(json.dumps(res, indent=2) if a.json else "\n".join(f"{k}: {v}" for k, v in res.items()))
        return
    with tempfile.TemporaryDirectory() as state:
        server, empty = Server(a.gb, Path(state)), Server(a.empty_gb or a.gb, Path(state), "--cold")
        try:
            server.start()
            empty.start()
            t0 = time.perf_counter()
            stored = fill(server, a.gb, a.object_mb)
            fill_s = time.perf_counter() - t0
            print(f"filled {stored} objects of {a.object_mb} MiB in {fill_s:.1f}s", file=sys.stderr)
            rounds: list[dict[str, Any]] = []
            for i in range(a.rounds):  # alternating: the full arena adopted, then an empty server's start
                server.kill()
                ready_s = server.start()
                with server.admin() as c:
                    while (warm := c.call("describe").result["warm_restart"])["pending"]:
                        time.sleep(0.05)
                empty.kill()
                counts = {k: warm[k] for k in ("adopted", "verified", "rejected", "verify_s")}
                rounds.append({"ready_s": ready_s, "empty_ready_s": empty.start(), **counts})
                print(f"round {i + 1}: {rounds[-1]}", file=sys.stderr)
        finally:
            server.remove()
            empty.remove()
    out: dict[str, Any] = {
        "gb": a.gb,
        "empty_gb": a.empty_gb or a.gb,
        "object_mb": a.object_mb,
        "stored": stored,
        "rounds": rounds,
    }
    for k in ("ready_s", "empty_ready_s", "verify_s"):
        vals = [r[k] for r in rounds]
        out[k] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
    if a.json:
        print(json.dumps(out, indent=2))
        return
    print(f"L1 {a.gb} GiB, {stored} objects of {a.object_mb} MiB, {a.rounds} kill -9 / restart rounds")
    whats = (
        ("ready_s", "adopting: spawn to first ping"),
        ("empty_ready_s", f"empty {out['empty_gb']} GiB: spawn to ping"),
        ("verify_s", "all adopted objects verified"),
    )
    for k, what in whats:
        s = out[k]
        print(f"  {what:32s} median {s['median']:.3f}s (range {s['min']:.3f}-{s['max']:.3f})")
    print(f"  adopted {[r['adopted'] for r in rounds]}, rejected {[r['rejected'] for r in rounds]}")


if __name__ == "__main__":
    main()

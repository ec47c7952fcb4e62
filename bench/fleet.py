"""Fleet routing at scale: the coordinator's event-fed prefix index with 1,000 instances and 10 M chunks.

One real `kvcli coordinator` process, one real kvserver publishing KV events (it stores a prompt,
so the index holds chunks that came from a real cache), and simulated instances
(tests/kvcli/siminstance.py: a KV-events PUB socket and a snapshot endpoint each, no cache)
spread over a few worker processes. Each simulated instance starts holding `--chunks-per-instance`
random chunks (the coordinator loads them from the first snapshot) plus prefixes of a few real
prompts, so lookups hit instances at different depths. Then:

1. fleet lookups of a 4096-token prompt, idle: p50 / p99 (client side, one reused connection),
   with the tokens as a JSON list and as base64 of packed uint32 (the compact form), and the
   coordinator's `GET /healthz` in the same run as the baseline (the HTTP round trip);
2. the simulated instances publish `--rate` events/s in total (stores of new chunks and removals
   of old ones, one event a batch) while lookups run again: lookup p50 / p99 under load, and the
   event-to-index lag (batch timestamp to applied, on the coordinator) p50 / p99;
3. index size: chunks, bytes the index structures take (`/v1/fleet/index?memory=true`) and the
   coordinator's RSS growth, each per chunk.

With `--fanout-baseline`, a few lookups with `"mode": "fanout"` (every instance asked, the
coordinator's only way before the index) are timed in the same run as the baseline.

Run: `uv run python -m bench.fleet [--instances 1000] [--chunks-per-instance 10000] [--rate 10000]`.
"""

from __future__ import annotations

import argparse
import base64
import json
import multiprocessing as mp
import os
import random
import secrets
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from kvtestkit.coordproc import CoordinatorProc, wait_for
from kvtestkit.kvhelpers import register, store, tiny_layout
from kvtestkit.serverproc import ServerProc, free_port

from kvprotocol import chunk_hashes, pack_tokens

MODEL = "bench-model"
CHUNK = 256
PROMPT_CHUNKS = 16  # 4096 tokens
PROMPTS = 8
GROUPS = ["0123456789abcdef"]


def prompt(i: int) -> list[int]:
    return [(i * 104_729 + t * 31) % 50_000 for t in range(PROMPT_CHUNKS * CHUNK)]


def low64(tokens: list[int]) -> list[int]:
    return [int.from_bytes(h[-8:], "big") for h in chunk_hashes(tokens, CHUNK)]


def worker(
    k: int, first: int, count: int, per_instance: int, coord: str, rate: float, ready: Any, go: Any, stop: Any
) -> None:
    import zmq

    from kvtestkit.siminstance import SimInstance, plain_auth

    ctx = zmq.Context()
    plain_auth(ctx, os.environ["KVSERVER_API_TOKEN"])  # the sims' event sockets take the fleet token
    rng = np.random.default_rng(k)
    prompts = [low64(prompt(p)) for p in range(PROMPTS)]
    sims = []
    with httpx.Client(trust_env=False, timeout=30) as http:
        for i in range(first, first + count):
            sim = SimInstance(ctx, f"sim{i}", CHUNK)
            sim.preload(MODEL, rng.integers(1, 2**63, size=per_instance, dtype=np.uint64))
            sim.preload(MODEL, np.array(prompts[i % PROMPTS][: 1 + i % PROMPT_CHUNKS], dtype=np.uint64))
            reply = sim.register(http, coord, os.environ["KVSERVER_API_TOKEN"])  # spawned: inherits the env
            reply.raise_for_status()
            sims.append(sim)
    ready.release()
    go.wait()
    fresh: list[list[int]] = [[] for _ in sims]  # chunks each sim stored during the run (removed later)
    sent, t0, i = 0, time.perf_counter(), 0
    while not stop.is_set():
        due = int((time.perf_counter() - t0) * rate) - sent
        if due <= 0:
            time.sleep(0.001)
            continue
        for _ in range(min(due, 1000)):
            sim, mine = sims[i % len(sims)], fresh[i % len(sims)]
            i += 1
            if len(mine) >= 4:
                sim.remove(MODEL, [mine.pop(0)])
            else:
                h = int(rng.integers(1, 2**63, dtype=np.uint64))
                mine.append(h)
                sim.store(MODEL, [h])
            sent += 1
    for sim in sims:
        sim.close()
    ctx.destroy(linger=0)


def lookups(url: str, n: int, body: dict[str, Any], warmup: int = 20) -> tuple[list[float], dict[str, Any]]:
    content = json.dumps(body).encode()
    out, last = [], {}
    headers = {"content-type": "application/json", "authorization": f"Bearer {os.environ['KVSERVER_API_TOKEN']}"}
    with httpx.Client(trust_env=False, timeout=120, headers=headers) as c:
        for _ in range(warmup):
            c.post(url, content=content).raise_for_status()
        for _ in range(n):
            t0 = time.perf_counter()
            reply = c.post(url, content=content)
            out.append((time.perf_counter() - t0) * 1e3)
            last = reply.json()
    return out, last


def healthz(url: str, n: int) -> list[float]:
    out = []
    with httpx.Client(trust_env=False, timeout=30) as c:
        for i in range(n + 20):
            t0 = time.perf_counter()
            c.get(url).raise_for_status()
            if i >= 20:
                out.append((time.perf_counter() - t0) * 1e3)
    return out


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def report(figures: dict[str, Any]) -> None:
    for key, value in figures.items():
        shown = round(value, 3) if isinstance(value, float) else value
        print(f"{key:24s}  {shown}")
    print(flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--instances", type=int, default=1000, help="simulated instances")
    ap.add_argument("--chunks-per-instance", type=int, default=10_000)
    ap.add_argument("--rate", type=float, default=10_000, help="events/s published in total under load")
    ap.add_argument("--workers", type=int, default=4, help="processes hosting the simulated instances")
    ap.add_argument("--lookups", type=int, default=1000)
    ap.add_argument("--fanout-baseline", action="store_true", help="also time 5 lookups asking every instance")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    os.environ["KVSERVER_API_TOKEN"] = secrets.token_urlsafe(24)  # the fleet's one token: every process here
    coord = CoordinatorProc(
        free_port(),
        ["--instance-timeout", "3600", "--fanout-timeout", "30"],
        tmp / "coordinator.log",
        env={"KVSERVER_API_TOKEN": os.environ["KVSERVER_API_TOKEN"]},
    ).start()
    base_rss = rss(coord.proc.pid)  # type: ignore[union-attr]
    server = ServerProc(
        free_port(),
        [
            "--coordinator",
            coord.url,
            "--heartbeat-interval",
            "5",
            "--chunk-size",
            str(CHUNK),
            "--kv-events-endpoint",
            f"tcp://127.0.0.1:{free_port()}",
        ],
        tmp / "kvserver.log",
        http_port=free_port(),
    ).start()
    ctx = mp.get_context("spawn")
    ready, go, stop = ctx.Semaphore(0), ctx.Event(), ctx.Event()
    per = -(-args.instances // args.workers)
    procs = []
    for k in range(args.workers):
        first, count = k * per, min(per, args.instances - k * per)
        if count <= 0:
            break
        procs.append(
            ctx.Process(
                target=worker,
                args=(k, first, count, args.chunks_per_instance, coord.url, args.rate / args.workers, ready, go, stop),
                daemon=True,
            )
        )
        procs[-1].start()
    index_url = f"{coord.url}/v1/fleet/index"
    figures: dict[str, Any] = {"instances": args.instances + 1, "rate": args.rate}
    try:
        with server.client() as c:  # the real instance holds prompt 0 in full
            ks, _ = register(c, model=MODEL, layouts=[tiny_layout(CHUNK)])
            size = tiny_layout(CHUNK).object_bytes
            store(c, ks, prompt(0), lambda ch, g: bytes(size))
        t0 = time.perf_counter()
        for _ in procs:
            ready.acquire()
        feeds = len(procs) and args.instances + 1
        state = wait_for(
            lambda: (s := httpx.get(index_url, headers=coord.auth, timeout=60).json())["synced"] == feeds and s,
            timeout=1800,
            interval=1.0,
            what="every feed in sync",
        )
        figures["load_s"] = round(time.perf_counter() - t0, 1)
        mem = httpx.get(index_url, headers=coord.auth, params={"memory": "true"}, timeout=600).json()
        figures["chunks"] = mem["chunks"]
        figures["index_bytes_per_chunk"] = round(mem["memory_bytes"] / max(1, mem["chunks"]), 1)
        figures["rss_bytes_per_chunk"] = round((rss(coord.proc.pid) - base_rss) / max(1, mem["chunks"]), 1)  # type: ignore[union-attr]
        body = {"model": MODEL, "world_size": 1, "groups": GROUPS, "tokens": prompt(0)}
        health = healthz(f"{coord.url}/healthz", args.lookups)  # the baseline: the framework's own round trip
        figures["coordinator_healthz_p50_ms"] = statistics.median(health)
        idle, answer = lookups(f"{coord.url}/v1/fleet/lookup", args.lookups, body)
        figures["lookup_idle_p50_ms"], figures["lookup_idle_p99_ms"] = statistics.median(idle), pct(idle, 0.99)
        figures["lookup_idle_p50_over_healthz"] = statistics.median(idle) / statistics.median(health)
        figures["lookup_answer"] = {k: answer[k] for k in ("prefix_tokens", "indexed", "fanned_out")}
        packed = {**body, "tokens": base64.b64encode(pack_tokens(body["tokens"])).decode()}
        if httpx.post(f"{coord.url}/v1/fleet/lookup", json=packed, timeout=60, headers=coord.auth).status_code == 200:
            compact, same = lookups(f"{coord.url}/v1/fleet/lookup", args.lookups, packed)  # tokens as base64
            figures["lookup_packed_p50_ms"], figures["lookup_packed_p99_ms"] = (
                statistics.median(compact),
                pct(compact, 0.99),
            )
            figures["lookup_packed_same_answer"] = same == answer
        figures["lookup_holders"] = len(answer["instances"])
        report(figures)
        if args.fanout_baseline:  # the old way, every instance asked
            fan, _ = lookups(f"{coord.url}/v1/fleet/lookup", 5, {**body, "mode": "fanout"}, warmup=1)
            figures["lookup_fanout_p50_ms"] = round(statistics.median(fan), 2)
        before = httpx.get(index_url, headers=coord.auth, timeout=60).json()
        go.set()
        time.sleep(3.0)  # reach the steady rate
        t1 = time.perf_counter()
        loaded, _ = lookups(f"{coord.url}/v1/fleet/lookup", args.lookups, body)
        after = httpx.get(index_url, headers=coord.auth, timeout=60).json()
        elapsed = time.perf_counter() - t1
        figures["lookup_loaded_p50_ms"], figures["lookup_loaded_p99_ms"] = statistics.median(loaded), pct(loaded, 0.99)
        figures["events_applied_per_s"] = round((after["events"] - before["events"]) / (elapsed + 3.0), 0)
        figures["lag_p50_ms"], figures["lag_p99_ms"] = after["lag_p50_ms"], after["lag_p99_ms"]
        figures["resyncs_under_load"] = after["resyncs"] - before["resyncs"]
        figures["gaps_under_load"] = after["gaps"] - before["gaps"]
        figures["load_check"] = {"synced": state["synced"], "feeds": state["feeds"]}
    finally:
        stop.set()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.terminate()
        server.stop()
        coord.stop()
    report(figures)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    random.seed(0)
    main()

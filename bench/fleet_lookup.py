"""The coordinator's own work per fleet lookup, without HTTP: its real ASGI app called in-process.

`bench/fleet.py` measures lookups end to end over HTTP, where a loaded machine's scheduling of the
client, the server and their sockets swamps the server's work. This calls the app directly (the
same middleware, decoding, index walk and encoding a request gets) with a fleet shaped like
bench_fleet's: `--instances` in-sync instances holding random chunks, every eighth one a prefix of
the prompt at depth 1 or 9, and one the whole 4096-token prompt (126 holders of 1,001). The index
is filled directly instead of from KV events (what is timed does not read events). It prints
`GET /healthz` as the framework's baseline and lookups with the tokens as a JSON list and as
base64 of packed uint32 (when the coordinator accepts that form): p50, p90 and the minimum, the
figure least disturbed by other jobs on the machine.

Run: `uv run python -m bench.fleet_lookup [--instances 1000] [--chunks-per-instance 200]`.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import time
from typing import Any

import numpy as np

from kvcoordinator.app import CoordinatorSettings, create_app
from kvcoordinator.registry import Registry
from kvcoordinator.subscriber import Feed
from kvprotocol import chunk_hashes, pack_tokens

MODEL, CHUNK, PROMPT_CHUNKS = "bench-model", 256, 16


def prompt(i: int) -> list[int]:  # bench/fleet.py's prompts
    return [(i * 104_729 + t * 31) % 50_000 for t in range(PROMPT_CHUNKS * CHUNK)]


def low64(tokens: list[int]) -> list[int]:
    return [int.from_bytes(h[-8:], "big") for h in chunk_hashes(tokens, CHUNK)]


def fill(app: Any, n: int, per: int) -> None:
    registry, feeds = app.state.registry, app.state.feeds["index"]
    prompts = [low64(prompt(p)) for p in range(8)]
    rng = np.random.default_rng(0)
    for i in range(n + 1):
        inst = registry.register(
            {
                "zmq_url": f"tcp://127.0.0.1:{10000 + i}",
                "http_url": f"http://127.0.0.1:{1 + i}",
                "version": "bench",
                "l1_capacity_bytes": 1 << 30,
                "chunk_size": CHUNK,
                "heartbeat_interval": 5.0,
                "models": [MODEL],
                "l1_used_bytes": i,
                "objects": 0,
            }
        )
        slot = feeds._alloc()
        feed = Feed(inst, slot, "kv@bench@", None)  # no socket: nothing is read from events here
        feeds.feeds[inst.id], feeds.by_slot[slot] = feed, feed
        feeds._chunk_sizes[CHUNK] += 1
        feeds._mark(feed, 0)
        keys = rng.integers(1, 2**63, size=per, dtype=np.uint64).tolist()
        keys += prompts[0] if i == n else prompts[i % 8][: 1 + i % PROMPT_CHUNKS]
        feeds.index.add(slot, feeds.index.keys(MODEL, keys))


async def call(app: Any, method: str, path: str, body: bytes) -> tuple[int, bytes]:
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"host", b"127.0.0.1"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 9090),
        "state": {},
    }
    sent, status, out = False, 0, []

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # never disconnects
        return {}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            out.append(message.get("body", b""))

    await app(scope, receive, send)
    return status, b"".join(out)


async def main(args: argparse.Namespace) -> None:
    app = create_app(CoordinatorSettings(), Registry(3600))
    async with app.router.lifespan_context(app):
        fill(app, args.instances, args.chunks_per_instance)
        base = {"model": MODEL, "world_size": 1, "groups": ["0123456789abcdef"]}
        cases = {
            "healthz": ("GET", "/healthz", b""),
            "lookup (list)": ("POST", "/v1/fleet/lookup", json.dumps({**base, "tokens": prompt(0)}).encode()),
        }
        packed = json.dumps({**base, "tokens": base64.b64encode(pack_tokens(prompt(0))).decode()}).encode()
        if (await call(app, "POST", "/v1/fleet/lookup", packed))[0] == 200:
            cases["lookup (packed)"] = ("POST", "/v1/fleet/lookup", packed)
        status, answer = await call(app, *cases["lookup (list)"])
        got = json.loads(answer)
        print(
            f"{args.instances + 1} instances; lookup: HTTP {status}, prefix {got['prefix_tokens']}, "
            f"{len(got['instances'])} listed, {got['indexed']} indexed"
        )
        for name, case in cases.items():
            times = []
            for _ in range(args.calls):
                t0 = time.perf_counter()
                await call(app, *case)
                times.append((time.perf_counter() - t0) * 1e6)
            times.sort()
            print(
                f"{name:16s} p50 {times[len(times) // 2]:8.1f} us   p90 {times[int(0.9 * len(times))]:8.1f} us"
                f"   min {times[0]:8.1f} us"
            )
        feeds = app.state.feeds["index"]
        feeds.feeds.clear()  # socketless feeds: nothing for close() to do
        feeds.by_slot.clear()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--instances", type=int, default=1000)
    ap.add_argument("--chunks-per-instance", type=int, default=200)
    ap.add_argument("--calls", type=int, default=2000)
    asyncio.run(main(ap.parse_args()))

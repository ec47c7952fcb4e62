"""HTTP plane latency: kvserver and coordinator against a bare FastAPI + uvicorn app, in one run.

Starts three real processes on loopback: a bare FastAPI app under uvicorn (its own `uvicorn.run`
binding, the framework's speed), a kvserver with its admin API, and a `kvcli coordinator` with that
kvserver registered. One reused `httpx.Client` per target sends sequential requests and the p50/p99
of each is printed with its ratio to the bare app's `GET /healthz`:

- `GET /healthz` on all three;
- `POST /v1/query` with 4096 tokens on kvserver (nothing cached: the reply is the full presence walk);
- `POST /v1/fleet/lookup` with 4096 tokens on the coordinator (one instance, answered from its index
  when the instance publishes KV events, otherwise by fan-out).

Run: `uv run python -m bench.http_api [--n 300]`.
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import httpx

from kvtestkit.coordproc import CoordinatorProc, wait_for
from kvtestkit.serverproc import ServerProc, free_port

from kvprotocol import resolve_token

BARE_APP = textwrap.dedent("""
    import sys
    import uvicorn
    from fastapi import FastAPI
    app = FastAPI()

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok"}

    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
""")


def timed(
    client: httpx.Client, method: str, url: str, n: int, body: object = None, token: str | None = None
) -> list[float]:
    """Latency of n sequential requests; a JSON body is encoded once (the client's cost, not the server's)."""
    content = json.dumps(body).encode() if body is not None else None
    headers = {"content-type": "application/json"} if body is not None else {}
    if token:
        headers["authorization"] = f"Bearer {token}"
    for _ in range(min(20, n)):  # warm up: connection, first-call imports
        client.request(method, url, content=content, headers=headers).raise_for_status()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        client.request(method, url, content=content, headers=headers).raise_for_status()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=300, help="requests per measurement")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-http-"))
    bare_port = free_port()
    bare = subprocess.Popen(
        [sys.executable, "-c", BARE_APP, str(bare_port)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
    )
    fleet = {"KVSERVER_API_TOKEN": secrets.token_urlsafe(24)}  # one token: coordinator and server
    coord = CoordinatorProc(free_port(), [], tmp / "coordinator.log", env=fleet).start()
    events = ["--kv-events-endpoint", f"tcp://127.0.0.1:{free_port()}"]
    server = ServerProc(
        free_port(),
        ["--coordinator", coord.url, "--heartbeat-interval", "1", *events],
        tmp / "kvserver.log",
        http_port=free_port(),
        env=fleet,
    ).start()
    try:
        bare_url = f"http://127.0.0.1:{bare_port}"
        wait_for(lambda: _up(bare_url), what="bare app")
        wait_for(lambda: coord.get("/v1/fleet/index").json()["synced"] == 1, what="index in sync")
        query = {"model": "bench", "world_size": 1, "groups": ["0123456789abcdef"], "tokens": list(range(4096))}
        rows: list[tuple[str, list[float]]] = []
        with httpx.Client(trust_env=False, timeout=10) as c:
            rows.append(("bare uvicorn   GET /healthz", timed(c, "GET", f"{bare_url}/healthz", args.n)))
            rows.append(("kvserver       GET /healthz", timed(c, "GET", f"{server.http_url}/healthz", args.n)))
            rows.append(("coordinator    GET /healthz", timed(c, "GET", f"{coord.url}/healthz", args.n)))
            rows.append(
                (
                    "kvserver       POST /v1/query 4096 tok",
                    timed(
                        c,
                        "POST",
                        f"{server.http_url}/v1/query",
                        args.n,
                        query,
                        resolve_token(server.token, server.http_url),
                    ),
                )
            )
            rows.append(
                (
                    "coordinator    POST /v1/fleet/lookup 4096 tok",
                    timed(c, "POST", f"{coord.url}/v1/fleet/lookup", args.n, query, coord.token),
                )
            )
        base = statistics.median(rows[0][1])
        print(f"{'what':46s} {'p50 ms':>8s} {'p99 ms':>8s} {'p50 / bare healthz':>19s}")
        for name, xs in rows:
            p50 = statistics.median(xs)
            print(f"{name:46s} {p50:8.2f} {pct(xs, 0.99):8.2f} {p50 / base:18.2f}x")
    finally:
        server.stop()
        coord.stop()
        bare.terminate()
        bare.wait(5)


def _up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=0.5).status_code == 200
    except httpx.HTTPError:
        return False


if __name__ == "__main__":
    main()

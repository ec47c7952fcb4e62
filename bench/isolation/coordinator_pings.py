"""Bystander latency at the fleet coordinator while a token-less client attacks it (#34 findings 1, 9).

Starts a real kvserver and a real coordinator (`kvcli coordinator`, authenticated by default with a
fleet token the server also holds), then alternates rounds: in "attack" rounds a thread without the
token tries what the findings did (register an instance at a URL of its choosing, forge a KV-event
feed's claims through registration, ask `/v1/fleet/lookup` in fan-out mode as a confused deputy,
read `/v1/fleet/status`), each answered 401; in "quiet" rounds it does nothing. The bystander is
the owner's authenticated `GET /v1/instances`; per condition it prints its median and range and the
ratio. After the run it checks that nothing of the attacker was registered (harness: bystander.py).
Run: `uv run python -m bench.isolation.coordinator_pings`.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from bench.isolation.bystander import Server, alternate, report
from kvtestkit.ports import free_port

BIN = Path(sys.executable).parent


class InstancesPing:
    """The owner's authenticated GET /v1/instances, shaped like a client's `ping` for `alternate`."""

    def __init__(self, url: str, token: str) -> None:
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=5)

    def ping(self) -> None:
        self.http.get("/v1/instances").raise_for_status()


def attack(url: str, stop: threading.Event, seen: dict[int, int]) -> None:
    reg = {
        "zmq_url": "tcp://127.0.0.1:1",
        "http_url": "http://[::1]:2",
        "l1_capacity_bytes": 1,
        "version": "0",
        "heartbeat_interval": 30.0,
    }
    look = {"model": "m", "world_size": 1, "groups": ["0123456789abcdef"], "tokens": [1, 2, 3], "mode": "fanout"}
    with httpx.Client(base_url=url, timeout=5) as stranger:
        while not stop.is_set():
            for r in (
                stranger.post("/v1/instances", json=reg),
                stranger.post("/v1/fleet/lookup", json=look),
                stranger.get("/v1/fleet/status"),
                stranger.post("/v1/instances", json=reg, headers={"Authorization": "Bearer guessed"}),
            ):
                seen[r.status_code] = seen.get(r.status_code, 0) + 1


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        token = secrets.token_urlsafe(32)
        port = free_port()
        env = {**os.environ, "KVSERVER_STATE_DIR": tmp, "KVSERVER_API_TOKEN": token}
        coord = subprocess.Popen(
            [str(BIN / "kvcli"), "coordinator", "--port", str(port), "--log-level", "warning"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        url = f"http://127.0.0.1:{port}"
        srv = None
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    if httpx.get(f"{url}/healthz", timeout=0.5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("coordinator did not start")
                time.sleep(0.1)
            os.environ["KVSERVER_API_TOKEN"] = token  # the server registers with the fleet token
            srv = Server(Path(tmp), None, "--l1-size-gb", "0.02", "--coordinator", url)
            srv.client(token).close()
            owner = InstancesPing(url, token)
            deadline = time.monotonic() + 30
            while not owner.http.get("/v1/instances").json()["instances"] and time.monotonic() < deadline:
                time.sleep(0.1)
            seen: dict[int, int] = {}
            times = alternate(owner, lambda stop: attack(url, stop, seen))  # type: ignore[arg-type]
            report("coordinator", times)
            print("stranger's answers by status:", dict(sorted(seen.items())))
            listed = owner.http.get("/v1/instances").json()["instances"]
            print(f"instances registered after the attack: {len(listed)} (1: the server only)")
        finally:
            if srv is not None:
                srv.stop()
            coord.terminate()
            coord.wait(10)


if __name__ == "__main__":
    main()

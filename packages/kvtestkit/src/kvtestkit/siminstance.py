"""A simulated kvserver for the coordinator's prefix index: KV events, a snapshot, registration.

What the coordinator sees of a real server's KV events, without the cache behind it: a ZMQ PUB
socket sending `(topic, seq, payload)` in kvserver's wire format, `GET /v1/kv-events/snapshot` over
HTTP, and registration and heartbeats. Light enough to run hundreds in one process (the fleet
benchmark), and able to misbehave on purpose (skip a sequence number, send a stale or malformed
batch, claim chunks it does not hold) for the tests of the index's resync rules.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import msgpack
import numpy as np
import zmq
from zmq.auth.thread import ThreadAuthenticator

MEDIUM = "kvserver_l1"


def plain_auth(ctx: zmq.Context, token: str) -> ThreadAuthenticator:
    """The ZAP handler of a context whose sims take PLAIN `kvserver` / `token`, as kvserver's event
    sockets do (stop it before destroying the context)."""
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_plain(domain="*", passwords={"kvserver": token})
    return auth


class SimInstance:
    def __init__(self, ctx: zmq.Context, name: str, chunk_size: int = 256, host: str = "127.0.0.1") -> None:
        self.name, self.chunk_size = name, chunk_size
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        self.pub.plain_server = True  # like kvserver's event sockets; the context's ZAP handler: plain_auth
        port = self.pub.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self.topic = f"kv@{name}@{{model}}"
        self.seq = 0
        self.blocks: dict[str, set[int]] = {}  # model -> low-64 hashes held (what the snapshot says)
        self.lock = threading.Lock()
        self.snapshots = 0
        self.http = ThreadingHTTPServer((host, 0), _handler(self))
        self.http.daemon_threads = True
        self.http_url = f"http://{host}:{self.http.server_address[1]}"
        self._thread = threading.Thread(target=self.http.serve_forever, daemon=True, name=f"sim-{name}")
        self._thread.start()
        self.instance_id: str | None = None

    # -- membership ------------------------------------------------------------------------------
    def registration(self) -> dict[str, Any]:
        return {
            "zmq_url": f"tcp://{self.name}.sim:5555",
            "http_url": self.http_url,
            "version": "sim",
            "l1_capacity_bytes": 1 << 30,
            "chunk_size": self.chunk_size,
            "heartbeat_interval": 5.0,
            "kv_events": {"endpoint": self.endpoint, "replay_endpoint": None, "topic": self.topic},
        }

    def register(self, client: httpx.Client, coordinator: str, token: str | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        reply = client.post(f"{coordinator}/v1/instances", json=self.registration(), headers=headers)
        if reply.status_code == 201:
            self.instance_id = reply.json()["instance_id"]
        return reply

    def heartbeat(self, client: httpx.Client, coordinator: str) -> httpx.Response:
        with self.lock:
            seq = self.seq
        return client.put(f"{coordinator}/v1/instances/{self.instance_id}/heartbeat", json={"kv_events_seq": seq})

    # -- events ----------------------------------------------------------------------------------
    def send(
        self,
        model: str,
        events: list[dict[str, Any]],
        *,
        seq: int | None = None,
        deliver: bool = True,
        payload: bytes | None = None,
    ) -> int:
        """Publish one batch (seq: the next one unless given; deliver=False: count it but drop it)."""
        with self.lock:
            if seq is None:
                seq, self.seq = self.seq, self.seq + 1
            body = payload if payload is not None else msgpack.packb([time.time(), events, 0], use_bin_type=True)
            if deliver:
                self.pub.send_multipart([self.topic.format(model=model).encode(), seq.to_bytes(8, "big"), body])
        return seq

    def store(self, model: str, hashes: list[int], *, deliver: bool = True, claim_only: bool = False) -> int:
        """BlockStored for `hashes` (int form); claim_only: announce without holding them (a lie)."""
        with self.lock:
            if not claim_only:
                self.blocks.setdefault(model, set()).update(hashes)
        return self.send(
            model,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": hashes,
                    "parent_block_hash": None,
                    "token_ids": [],
                    "block_size": self.chunk_size,
                    "lora_id": None,
                    "medium": MEDIUM,
                    "lora_name": None,
                }
            ],
            deliver=deliver,
        )

    def remove(self, model: str, hashes: list[int], *, deliver: bool = True) -> int:
        with self.lock:
            self.blocks.get(model, set()).difference_update(hashes)
        return self.send(model, [{"type": "BlockRemoved", "block_hashes": hashes, "medium": MEDIUM}], deliver=deliver)

    def restart(self) -> None:
        """A new server process on the same endpoints: seq 0, AllBlocksCleared first."""
        with self.lock:
            self.seq = 0
            self.blocks.clear()
        self.send("", [{"type": "AllBlocksCleared"}])

    def preload(self, model: str, hashes: np.ndarray) -> None:
        """Hold chunks from the start (the coordinator gets them from the first snapshot)."""
        with self.lock:
            self.blocks.setdefault(model, set()).update(hashes.tolist())

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            self.snapshots += 1
            models = {
                m: base64.b64encode(np.fromiter(hs, dtype="<u8", count=len(hs)).tobytes()).decode()
                for m, hs in self.blocks.items()
            }
            return {"next_seq": self.seq, "medium": MEDIUM, "chunk_size": self.chunk_size, "models": models}

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()
        self.pub.close(linger=0)


def _handler(sim: SimInstance) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path != "/v1/kv-events/snapshot":
                self.send_error(404)
                return
            body = json.dumps(sim.snapshot()).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    return Handler

"""`GET /v1/kv-events/snapshot`: the blocks announced and not removed, and the seq the stream goes on from."""

from __future__ import annotations

import base64
from typing import Any

import httpx
import numpy as np

from kvevents_util import CHUNK
from kvtestkit.kvhelpers import payload, register, store, tiny_layout
from kvprotocol import chunk_hashes
from kvtestkit.serverproc import free_port


def _blocks(snap: dict[str, Any]) -> dict[str, set[int]]:
    return {m: set(np.frombuffer(base64.b64decode(v), dtype="<u8").tolist()) for m, v in snap["models"].items()}


def _low64(tokens: list[int]) -> set[int]:
    return {int.from_bytes(h[-8:], "big") for h in chunk_hashes(tokens, CHUNK)}


def test_snapshot_matches_what_was_announced(server_factory: Any) -> None:
    srv = server_factory("--kv-events-endpoint", f"tcp://127.0.0.1:{free_port()}", "--l1-size-gb", "0.25", http=True)
    size = tiny_layout().object_bytes
    a, b = [1] * (2 * CHUNK), [2] * (3 * CHUNK)
    with srv.client() as c, srv.http() as h:
        ks, _ = register(c, model="m1", layouts=[tiny_layout()])
        store(c, ks, a, lambda ch, g: payload(ch, size))
        ks2, _ = register(c, model="m2", layouts=[tiny_layout()])
        store(c, ks2, b, lambda ch, g: payload(ch, size))
        snap = h.get("/v1/kv-events/snapshot").json()
        assert snap["medium"] == "kvserver_l1" and snap["chunk_size"] == CHUNK
        assert _blocks(snap) == {"m1": _low64(a), "m2": _low64(b)}
        assert snap["next_seq"] == c.call("describe").result["kv_events"]["next_seq"] >= 3
        assert h.post("/v1/clear").status_code == 200
        cleared = h.get("/v1/kv-events/snapshot").json()
        assert _blocks(cleared) == {} and cleared["next_seq"] > snap["next_seq"]
        # it reveals what is cached: the key token is needed even on loopback
        assert httpx.get(f"{srv.http_url}/v1/kv-events/snapshot", trust_env=False).status_code == 401


def test_snapshot_is_404_without_events(server_factory: Any) -> None:
    srv = server_factory("--l1-size-gb", "0.05", http=True)
    with srv.http() as h:
        reply = h.get("/v1/kv-events/snapshot")
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "NOT_FOUND"

"""The admin API over real HTTP against a real kvserver process: every endpoint, and bad input."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from kvtestkit.httpkv import CHUNK, fill, keys_body, prompt
from kvtestkit.kvhelpers import register, store, tiny_layout
from kvtestkit.serverproc import ServerProc, free_port


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """One server for the module; each test uses its own model name, so tests stay independent."""
    srv = ServerProc(
        free_port(),
        ["--l1-size-gb", "0.05", "--chunk-size", str(CHUNK)],
        tmp_path_factory.mktemp("api") / "kvserver.log",
        http_port=free_port(),
    ).start()
    yield srv
    srv.stop()


def test_probes_status_and_openapi(api: ServerProc) -> None:
    with api.http(timeout=5) as h:
        assert h.get("/healthz").json() == {"status": "ok"}
        ready = h.get("/readyz")
        assert ready.status_code == 200 and ready.json() == {"ready": True}
        status = h.get("/v1/status").json()
        assert status["config"]["port"] == api.port and status["config"]["http_port"] == api.http_port
        assert status["l1"]["capacity_bytes"] > 0 and status["config"]["chunk_size"] == CHUNK
        paths = h.get("/openapi.json").json()["paths"]
        assert {
            "/healthz",
            "/readyz",
            "/metrics",
            "/v1/status",
            "/v1/query",
            "/v1/clear",
            "/v1/pin",
            "/v1/unpin",
        } <= set(paths)


def test_query_reports_per_chunk_presence_and_prefix(api: ServerProc) -> None:
    tokens = prompt(4, tail=5)
    with api.client() as c, api.http(timeout=5) as h:
        ks, _ = register(c, model="m-query", layouts=[tiny_layout(CHUNK)])
        before = h.post("/v1/query", json=keys_body(ks, tokens)).json()
        assert before["prefix_tokens"] == 0 and [ch["l1"] for ch in before["chunks"]] == [0, 0, 0, 0]
        store(c, ks, tokens[: 2 * CHUNK], fill)  # chunks 0 and 1
        store(c, ks, tokens, fill, start_chunk=3)  # chunk 3 only: a hole at chunk 2
        after = h.post("/v1/query", json=keys_body(ks, tokens)).json()
    assert [ch["l1"] for ch in after["chunks"]] == [1, 1, 0, 1]
    assert all(ch["objects"] == 1 for ch in after["chunks"])
    assert after["prefix_tokens"] == 2 * CHUNK  # the hole ends the prefix
    assert after["num_tokens"] == len(tokens) and after["chunk_size"] == CHUNK


def test_salt_isolates_query(api: ServerProc) -> None:
    tokens = prompt(2)
    with api.client() as c, api.http(timeout=5) as h:
        ks, _ = register(c, model="m-salt", layouts=[tiny_layout(CHUNK)])
        store(c, ks, tokens, fill, salt="tenant-a")
        assert h.post("/v1/query", json=keys_body(ks, tokens, salt="tenant-a")).json()["prefix_tokens"] == 2 * CHUNK
        assert h.post("/v1/query", json=keys_body(ks, tokens, salt="tenant-b")).json()["prefix_tokens"] == 0
        assert h.post("/v1/query", json=keys_body(ks, tokens)).json()["prefix_tokens"] == 0


def test_pin_unpin_and_clear(api: ServerProc) -> None:
    tokens = prompt(3)
    with api.client() as c, api.http(timeout=5) as h:
        h.post("/v1/clear")  # the module's server is shared: start this one from empty
        ks, _ = register(c, model="m-pin", layouts=[tiny_layout(CHUNK)])
        store(c, ks, tokens, fill)
        assert h.post("/v1/pin", json=keys_body(ks, tokens[: 2 * CHUNK])).json() == {"objects": 2}
        assert h.get("/v1/status").json()["l1"]["pinned"] == 2
        assert h.post("/v1/unpin", json=keys_body(ks, tokens)).json() == {"objects": 3}
        assert h.get("/v1/status").json()["l1"]["pinned"] == 0
        assert h.post("/v1/clear").json() == {"removed": 3}
        assert h.post("/v1/query", json=keys_body(ks, tokens)).json()["prefix_tokens"] == 0
        assert h.get("/v1/status").json()["l1"]["objects"] == 0


def _error(resp: httpx.Response, status: int, code: str) -> str:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["error"]["code"] == code, body
    assert body["error"]["message"]
    return str(body["error"]["message"])


def test_bad_requests_get_4xx_with_a_message_and_change_nothing(api: ServerProc) -> None:
    tokens = prompt(2)
    with api.client() as c, api.http(timeout=10) as h:
        ks, _ = register(c, model="m-bad", layouts=[tiny_layout(CHUNK)])
        store(c, ks, tokens, fill)
        good = keys_body(ks, tokens)
        objects = h.get("/v1/status").json()["l1"]["objects"]
        json_headers = {"content-type": "application/json"}
        _error(h.post("/v1/query", content=b"{not json", headers=json_headers), 400, "BAD_JSON")
        _error(h.post("/v1/pin", content=b"[1, 2", headers=json_headers), 400, "BAD_JSON")
        deep = b"[" * 5000 + b"]" * 5000  # msgspec's depth guard raises RecursionError: a 400, not a 500
        assert "nested too deeply" in _error(h.post("/v1/query", content=deep, headers=json_headers), 400, "BAD_JSON")
        _error(h.post("/v1/query", content=b'{"tokens": ' + deep + b"}", headers=json_headers), 400, "BAD_JSON")
        assert "tokens" in _error(
            h.post("/v1/query", json={k: v for k, v in good.items() if k != "tokens"}), 422, "BAD_FIELD"
        )
        _error(h.post("/v1/query", json={**good, "tokens": [1, -1]}), 422, "BAD_FIELD")
        _error(h.post("/v1/query", json={**good, "tokens": [1, 2**32]}), 422, "BAD_FIELD")
        _error(h.post("/v1/query", json={**good, "tokens": ["1"]}), 422, "BAD_FIELD")
        _error(h.post("/v1/query", json={**good, "world_size": True}), 422, "BAD_FIELD")
        assert "session" in _error(h.post("/v1/query", json={**good, "session": "x"}), 422, "BAD_FIELD")
        assert "fingerprint" in _error(h.post("/v1/pin", json={**good, "groups": ["XYZ"]}), 422, "BAD_FIELD")
        _error(h.post("/v1/unpin", json={**good, "model": "bad model!"}), 422, "BAD_FIELD")
        _error(h.post("/v1/query", json={**good, "world_size": 10**6}), 422, "OUT_OF_RANGE")
        _error(h.post("/v1/query", json={**good, "salt": "no spaces allowed"}), 422, "BAD_FIELD")
        _error(h.post("/v1/query", content=b" " * (33 << 20), headers=json_headers), 413, "TOO_LARGE")
        _error(h.post("/v1/query", json={**good, "tokens": [1] * ((1 << 20) + 1)}), 413, "TOO_LARGE")
        _error(h.get("/v1/nope"), 404, "NOT_FOUND")
        _error(h.get("/v1/clear"), 405, "METHOD_NOT_ALLOWED")
        # nothing changed, and the server still serves both doors
        status = h.get("/v1/status").json()
        assert status["l1"]["objects"] == objects and status["l1"]["pinned"] == 0
        assert h.post("/v1/query", json=good).json()["prefix_tokens"] == 2 * CHUNK
        assert c.call("ping").result["protocol"] == 1

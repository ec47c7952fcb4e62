"""Bearer tokens on the admin API, the refusal of unauthenticated network binds, and no leaks."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx
import pytest

from kvtestkit.httpkv import CHUNK, fill, keys_body, prompt
from kvtestkit.kvhelpers import register, store, tiny_layout
from kvtestkit.serverproc import BIN, free_port

TOKEN = "tok-3f9c2a7b1e"
MUTATING = ("/v1/clear", "/v1/pin", "/v1/unpin", "/v1/query")  # a key query reveals cache contents


def _env_without_token() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "KVSERVER_API_TOKEN"}


def test_key_endpoints_need_the_token_status_and_metrics_stay_open_on_loopback(server_factory) -> None:
    srv = server_factory(
        "--chunk-size", str(CHUNK), "--l1-size-gb", "0.05", http=True, env={"KVSERVER_API_TOKEN": TOKEN}
    )
    tokens = prompt(2)
    with srv.client() as c, httpx.Client(base_url=srv.http_url, timeout=5) as h:
        ks, _ = register(c, layouts=[tiny_layout(CHUNK)])
        store(c, ks, tokens, fill)
        body = keys_body(ks, tokens)
        for path in MUTATING:
            missing = h.post(path, json=body)
            assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
            assert missing.json()["error"]["code"] == "UNAUTHORIZED"
            wrong = h.post(path, json=body, headers={"Authorization": f"Bearer {TOKEN}x"})
            assert wrong.status_code == 403 and wrong.json()["error"]["code"] == "FORBIDDEN"
            basic = h.post(path, json=body, headers={"Authorization": f"Basic {TOKEN}"})
            assert basic.status_code == 403
        # refused requests changed nothing
        assert h.get("/v1/status").json()["l1"]["objects"] == 2
        assert h.get("/v1/status").json()["l1"]["pinned"] == 0
        # aggregates need no token on loopback
        for path in ("/healthz", "/readyz", "/metrics", "/v1/status", "/openapi.json"):
            assert h.get(path).status_code == 200, path
        auth = {"Authorization": f"Bearer {TOKEN}"}
        assert h.post("/v1/query", json=body, headers=auth).json()["prefix_tokens"] == 2 * CHUNK
        assert h.post("/v1/pin", json=body, headers=auth).json() == {"objects": 2}
        assert h.post("/v1/unpin", json=body, headers=auth).json() == {"objects": 2}
        assert h.post("/v1/clear", headers=auth).json() == {"removed": 2}


def test_without_a_configured_token_the_generated_one_guards_mutations(server_factory) -> None:
    srv = server_factory(http=True, env={"KVSERVER_API_TOKEN": ""})
    with httpx.Client(base_url=srv.http_url, timeout=5) as h:
        assert h.post("/v1/clear").status_code == 401
        assert h.get("/v1/status").json()["config"]["api_token"] is None
    with srv.http() as h:  # the same user reads the generated token file
        assert h.post("/v1/clear").json() == {"removed": 0}


@pytest.mark.parametrize("flags", [["--http-host", "0.0.0.0"], ["--host", "0.0.0.0", "--http-port", "0"]])
def test_non_loopback_bind_without_token_is_refused(flags: list[str]) -> None:
    cmd = [str(BIN / "kvserver"), "start", "--port", str(free_port()), "--http-port", str(free_port()), *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=_env_without_token())
    assert done.returncode == 2
    assert "refusing to listen on non-loopback address 0.0.0.0" in done.stderr
    assert "--insecure" in done.stderr and "--api-token" in done.stderr


def test_insecure_overrides_the_refusal(server_factory) -> None:
    srv = server_factory("--http-host", "0.0.0.0", "--insecure", http=True, env={"KVSERVER_API_TOKEN": ""})
    with srv.http() as h:  # it serves, still guarded by the generated token
        assert h.get("/v1/status").json()["config"]["insecure"] is True
        assert h.post("/v1/clear").status_code == 200
    assert "--insecure" in srv.log()  # the override is logged


def test_off_loopback_every_endpoint_but_the_probes_needs_the_token(server_factory) -> None:
    srv = server_factory("--http-host", "0.0.0.0", "--api-token", TOKEN, http=True)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=srv.http_url, timeout=5) as h:
        assert h.get("/healthz").status_code == 200 and h.get("/readyz").status_code == 200
        for path in ("/metrics", "/v1/status"):
            assert h.get(path).status_code == 401, path
            assert h.get(path, headers=auth).status_code == 200, path
        body = {"model": "m", "world_size": 1, "groups": ["0123456789abcdef"], "tokens": [1, 2, 3]}
        assert h.post("/v1/query", json=body).status_code == 401
        assert h.post("/v1/query", json=body, headers=auth).status_code == 200


def test_no_endpoint_returns_secrets_or_environment(server_factory) -> None:
    marker, password = "env-marker-5d1e0c", "hunter2-pw-9a"
    redis_down = f"redis://:{password}@127.0.0.1:{free_port()}/0"  # nothing listens: the tier stays down
    srv = server_factory("--l2", redis_down, http=True, env={"KVSERVER_API_TOKEN": TOKEN, "SOME_SECRET": marker})
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=srv.http_url, timeout=5) as h:
        texts = [
            h.get(path, headers=auth).text
            for path in ("/healthz", "/readyz", "/metrics", "/v1/status", "/openapi.json", "/docs", "/v1/nope")
        ]
    assert texts[3] and '"api_token":"<set>"' in texts[3]
    assert '"redis://<redacted>@127.0.0.1' in texts[3]
    for text in texts:
        assert TOKEN not in text and marker not in text and password not in text and "PATH" not in text


def test_busy_http_port_fails_start_cleanly(server_factory) -> None:
    first = server_factory(http=True)
    port = free_port()
    cmd = [str(BIN / "kvserver"), "start", "--port", str(port), "--http-port", str(first.http_port)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=_env_without_token())
    assert done.returncode == 1
    assert f"cannot listen for HTTP on 127.0.0.1:{first.http_port}" in done.stderr
    assert not Path(f"/dev/shm/kvserver-{port}").exists()  # the arena was released
    with httpx.Client(base_url=first.http_url, timeout=5) as h:
        assert h.get("/healthz").status_code == 200

"""The ZMQ plane needs the server's token on every op but ping, on loopback too; CURVE beyond it."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import httpx
import msgpack
import pytest
import zmq

from kvtestkit.kvhelpers import register
from kvprotocol import PROTOCOL_VERSION, Client, RequestTimeout, ServerError
from kvtestkit.serverproc import BIN, free_port

TOKEN = "s3cret-token-for-tests"


def _refused(client: Client, op: str, **fields) -> str:
    with pytest.raises(ServerError) as err:
        client.call(op, **fields)
    return str(err.value.code)


def test_default_token_is_generated_private_and_found_by_same_user_clients(server_factory, monkeypatch):
    monkeypatch.delenv("KVSERVER_API_TOKEN", raising=False)
    srv = server_factory("--l1-size-gb", "0.01", http=True)
    state = Path(os.environ["KVSERVER_STATE_DIR"])
    token_file = state / f"token-{srv.port}"
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert (state / f"token-{srv.http_port}").read_text() == token_file.read_text()
    assert str(token_file) in srv.log()  # the banner says where clients find it
    busy = subprocess.run(
        [str(BIN / "kvserver"), "start", "--port", str(srv.port), "--http-port", "0", "--api-token", "another-token"],
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )
    assert busy.returncode != 0  # a server that cannot bind the port never overwrites its owner's file
    assert token_file.read_text() != "another-token"
    with Client(srv.url, timeout=5) as same_user:  # zero configuration: reads the default file
        register(same_user)
        assert same_user.call("clear").result == {"removed": 0}
    with Client(srv.url, timeout=5, token="wrong") as bad:
        assert bad.call("ping").result["protocol"] == PROTOCOL_VERSION  # open, like /healthz
        for op in ("describe", "clear"):
            assert _refused(bad, op) == "UNAUTHORIZED"
    token = token_file.read_text()
    with httpx.Client(base_url=srv.http_url, timeout=5) as h:
        assert h.post("/v1/clear").status_code == 401
        assert h.post("/v1/clear", headers={"Authorization": f"Bearer {token}"}).status_code == 200
    srv.stop()
    again = server_factory("--l1-size-gb", "0.01", port=srv.port)  # a restart keeps the token
    assert token_file.read_text() == token
    with Client(again.url, timeout=5) as c:
        assert "engines" in c.call("describe").result


def test_configured_token_is_enforced_on_loopback_zmq_and_http(server_factory, monkeypatch):
    """The finding: with --api-token, HTTP /v1/clear answered 401 but ZMQ clear succeeded."""
    monkeypatch.delenv("KVSERVER_API_TOKEN", raising=False)
    srv = server_factory("--l1-size-gb", "0.01", "--api-token", TOKEN, http=True)
    with Client(srv.url, timeout=5, token="not-the-token") as anon:
        for op in ("clear", "describe"):
            assert _refused(anon, op) == "UNAUTHORIZED"
    with httpx.Client(base_url=srv.http_url, timeout=5) as h:
        assert h.post("/v1/clear").status_code == 401
    with Client(srv.url, timeout=5, token=TOKEN) as good:
        register(good)
        described = good.call("describe").result
        assert described["config"]["api_token"] == "<set>" and TOKEN not in str(described)
        assert described["errors"]["UNAUTHORIZED"] == 2
    with Client(srv.url, timeout=5) as same_user:  # the server published its configured token too
        assert same_user.call("clear").result == {"removed": 0}
    monkeypatch.setenv("KVSERVER_API_TOKEN", TOKEN)  # the one variable every client reads
    with Client(srv.url, timeout=5) as from_env:
        assert from_env.call("clear").result == {"removed": 0}


def test_api_token_file(server_factory, tmp_path, monkeypatch):
    monkeypatch.delenv("KVSERVER_API_TOKEN", raising=False)
    path = tmp_path / "tok"
    path.write_text(TOKEN + "\n")
    srv = server_factory("--l1-size-gb", "0.01", "--api-token-file", str(path))
    with Client(srv.url, timeout=5, token=TOKEN) as good:
        assert "engines" in good.call("describe").result
    monkeypatch.setenv("KVSERVER_API_TOKEN_FILE", str(path))  # clients read the same file
    with Client(srv.url, timeout=5) as from_file:
        assert "engines" in from_file.call("describe").result


def test_beyond_loopback_curve_is_on_and_a_client_without_the_key_gets_nothing(server_factory, monkeypatch):
    monkeypatch.delenv("KVSERVER_API_TOKEN", raising=False)
    srv = server_factory("--l1-size-gb", "0.01", "--host", "0.0.0.0", "--api-token", TOKEN)
    assert "curve-key=" in srv.log()
    # no server key: the handshake never completes
    with Client(srv.url, timeout=1, token=TOKEN) as plain, pytest.raises(RequestTimeout):
        plain.call("ping")
    wrong_key = zmq.curve_keypair()[0].decode()
    with Client(srv.url, timeout=1, token=TOKEN, server_key=wrong_key) as wrong, pytest.raises(RequestTimeout):
        wrong.call("ping")
    with Client(srv.url, timeout=5, token="bad", server_key=srv.server_key) as no_token:  # CURVE and token
        assert no_token.call("ping").result["protocol"] == PROTOCOL_VERSION
        assert _refused(no_token, "describe") == "UNAUTHORIZED"
    monkeypatch.setenv("KVSERVER_SERVER_KEY", srv.server_key)  # clients read the key from the env too
    with Client(srv.url, timeout=5, token=TOKEN) as good:
        register(good)
        assert good.call("clear").result == {"removed": 0}


def test_curve_on_loopback_carries_kv(server_factory):
    srv = server_factory("--l1-size-gb", "0.01", "--curve")
    from kvtestkit.kvhelpers import lookup, store, tiny_layout

    with srv.client() as c:
        ks, _ = register(c, layouts=[tiny_layout()])
        toks = list(range(512))
        store(c, ks, toks, lambda ch, g: bytes([ch]) * tiny_layout().object_bytes)
        assert lookup(c, ks, toks) == 512
    with Client(srv.url, timeout=1) as plain, pytest.raises(RequestTimeout):
        plain.call("ping")


def test_no_curve_beyond_loopback_needs_insecure():
    cmd = [
        str(BIN / "kvserver"),
        "start",
        "--port",
        str(free_port()),
        "--http-port",
        "0",
        "--host",
        "0.0.0.0",
        "--api-token",
        TOKEN,
        "--no-curve",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=30)
    assert done.returncode == 2 and "without CURVE" in done.stderr


def test_auth_field_is_validated(server_factory):
    srv = server_factory("--l1-size-gb", "0.01")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(srv.url)
    sock.send(msgpack.packb({"v": PROTOCOL_VERSION, "id": 1, "op": "describe", "auth": 12345}))
    assert sock.poll(5000)
    reply = msgpack.unpackb(sock.recv())
    assert reply["ok"] is False and reply["error"]["code"] == "BAD_FIELD"
    sock.close()

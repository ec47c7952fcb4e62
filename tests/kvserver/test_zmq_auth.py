"""A control plane bound beyond loopback needs the API token on every op but ping."""

from __future__ import annotations

import msgpack
import pytest
import zmq

from kvhelpers import register
from kvprotocol import PROTOCOL_VERSION, Client, ServerError

TOKEN = "s3cret-token-for-tests"


def test_token_required_beyond_loopback(server_factory, monkeypatch):
    monkeypatch.delenv("KVSERVER_API_TOKEN", raising=False)
    srv = server_factory("--l1-size-gb", "0.01", "--host", "0.0.0.0", "--api-token", TOKEN)
    with Client(srv.url, timeout=5) as anon:
        assert anon.call("ping").result["protocol"] == PROTOCOL_VERSION  # open, like /healthz
        for op in ("describe", "clear"):
            with pytest.raises(ServerError) as err:
                anon.call(op)
            assert err.value.code == "UNAUTHORIZED"
            assert TOKEN not in err.value.message
    with Client(srv.url, timeout=5, token="wrong") as bad:
        with pytest.raises(ServerError) as err:
            bad.call("describe")
        assert err.value.code == "UNAUTHORIZED"
    with Client(srv.url, timeout=5, token=TOKEN) as good:
        register(good)
        described = good.call("describe").result
        assert described["config"]["api_token"] == "<set>" and TOKEN not in str(described)
    monkeypatch.setenv("KVSERVER_API_TOKEN", TOKEN)
    with Client(srv.url, timeout=5) as from_env:
        assert from_env.call("describe").result["errors"]["UNAUTHORIZED"] == 3


def test_loopback_needs_no_token_and_auth_field_is_validated(server_factory, monkeypatch):
    monkeypatch.delenv("KVSERVER_API_TOKEN", raising=False)
    srv = server_factory("--l1-size-gb", "0.01", "--api-token", TOKEN)
    with Client(srv.url, timeout=5) as c:
        assert "engines" in c.call("describe").result
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(srv.url)
    sock.send(msgpack.packb({"v": PROTOCOL_VERSION, "id": 1, "op": "describe", "auth": 12345}))
    assert sock.poll(5000)
    reply = msgpack.unpackb(sock.recv())
    assert reply["ok"] is False and reply["error"]["code"] == "BAD_FIELD"
    sock.close()

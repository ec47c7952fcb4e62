"""KV-event options: bad endpoints are refused, off loopback needs the token, which then guards the sockets."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvevents_util import sync
from kvtestkit.kvhelpers import register, tiny_layout
from kvprotocol import resolve_token
from kvserver.config import ServerConfig
from kvserver.kvevents import PLAIN_USER
from kvtestkit.kvsub import Subscriber, replay
from kvtestkit.serverproc import free_port

KVSERVER = Path(sys.executable).parent / "kvserver"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"kv_events_endpoint": "tcp://0.0.0.0:5557"}, "without an API token"),
        (
            {"kv_events_endpoint": "tcp://127.0.0.1:5557", "kv_events_replay_endpoint": "tcp://*:5558"},
            "without an API token",
        ),
        ({"kv_events_endpoint": "udp://127.0.0.1:5557"}, "must be tcp://HOST:PORT"),
        ({"kv_events_endpoint": "tcp://127.0.0.1"}, "must be tcp://HOST:PORT"),
        ({"kv_events_replay_endpoint": "tcp://127.0.0.1:5558"}, "needs --kv-events-endpoint"),
        (
            {"kv_events_endpoint": "tcp://127.0.0.1:5557", "kv_events_replay_endpoint": "tcp://127.0.0.1:5557"},
            "must differ",
        ),
        ({"kv_events_endpoint": "tcp://127.0.0.1:5557", "kv_events_topic": "kv@{pod}"}, "{host} and {model}"),
    ],
)
def test_bad_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        ServerConfig(**options)


def test_defaults_are_off_and_loopback_and_token_or_insecure_allow_the_network():
    assert ServerConfig().kv_events_endpoint is None
    ServerConfig(kv_events_endpoint="tcp://127.0.0.1:5557", kv_events_replay_endpoint="ipc:///tmp/kv-replay")
    ServerConfig(kv_events_endpoint="tcp://0.0.0.0:5557", api_token="secret")
    ServerConfig(kv_events_endpoint="tcp://[::]:5557", insecure=True)


def test_cli_refuses_a_public_endpoint_without_a_token():
    done = subprocess.run(
        [
            str(KVSERVER),
            "start",
            "--port",
            str(free_port()),
            "--http-port",
            "0",
            "--kv-events-endpoint",
            "tcp://0.0.0.0:5557",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "--kv-events-endpoint" in done.stderr


def test_off_loopback_the_sockets_take_the_api_token(server_factory):
    pub, rep = free_port(), free_port()
    srv = server_factory(
        "--l1-size-gb",
        "0.25",
        "--kv-events-endpoint",
        f"tcp://0.0.0.0:{pub}",
        "--kv-events-replay-endpoint",
        f"tcp://0.0.0.0:{rep}",
        env={"KVSERVER_API_TOKEN": "s3cret"},
    )
    endpoint, replay_endpoint = f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{rep}"
    creds = (PLAIN_USER, "s3cret")
    anonymous = Subscriber(endpoint)
    wrong = Subscriber(endpoint, plain=(PLAIN_USER, "guess"))
    good = Subscriber(endpoint, plain=creds)
    with srv.client() as c:
        ks, _ = register(c, layouts=[tiny_layout()])
        batches = sync(good, c, ks, replay_endpoint, plain=creds)
    assert any(ev["type"] == "BlockStored" for b in batches for ev in b.events)
    assert anonymous.recv(timeout_ms=300) is None and wrong.recv(timeout_ms=300) is None
    with pytest.raises(AssertionError, match="replay did not answer"):
        replay(replay_endpoint, 0, timeout_ms=500)
    assert replay(replay_endpoint, 0, plain=creds)[0].events == [{"type": "AllBlocksCleared"}]
    for sub in (anonymous, wrong, good):
        sub.close()


def test_ipv6_loopback_and_ipc_endpoints(server_factory, tmp_path):
    rep = free_port()
    srv = server_factory(
        "--kv-events-endpoint", f"ipc://{tmp_path}/events.ipc", "--kv-events-replay-endpoint", f"tcp://[::1]:{rep}"
    )
    creds = (PLAIN_USER, resolve_token(None, srv.url) or "")  # the server's generated token, on loopback too
    assert replay(f"tcp://[::1]:{rep}", 0, plain=creds)[0].events == [{"type": "AllBlocksCleared"}]
    sub = Subscriber(f"ipc://{tmp_path}/events.ipc", plain=creds)
    with srv.client() as c:
        ks, _ = register(c, layouts=[tiny_layout()])
        assert sync(sub, c, ks, f"tcp://[::1]:{rep}", plain=creds)[0].seq == 0
    sub.close()


def test_an_events_port_in_use_is_named_and_the_server_does_not_start(server_factory):
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = f"tcp://127.0.0.1:{squatter.getsockname()[1]}"
        srv = server_factory("--kv-events-endpoint", taken, start=False)
        with pytest.raises(RuntimeError) as refused:
            srv.start()
    assert f"cannot bind the KV events endpoint {taken}: Address already in use" in str(refused.value)
    assert srv.proc is not None and srv.proc.returncode != 0

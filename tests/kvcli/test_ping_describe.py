"""`kvcli ping` and `kvcli describe` against real servers, and every way a server can be unusable."""

from __future__ import annotations

from kvprotocol import PROTOCOL_VERSION, Client

from kvcli_testutil import CLI, assert_one_line_error, assert_usage_error
from kvtestkit.kvhelpers import register, store, tiny_layout


def test_ping_reports_version_and_rtt(cli: CLI, server) -> None:
    run = cli("ping", "--url", server.url, "--json", "-c", "3")
    assert run.code == 0, run.err
    z = run.json()["zmq"]
    assert run.json()["ok"] is True
    assert z["protocol"] == PROTOCOL_VERSION and z["version"] == "0.1.0"
    assert z["count"] == 3 and 0 < z["rtt_ms"] <= z["rtt_ms_avg"]
    human = cli("ping", "--url", server.url)
    assert human.code == 0 and f"{server.url}: kvserver 0.1.0 protocol {PROTOCOL_VERSION}" in human.out


def test_ping_http_health(cli: CLI, server_factory) -> None:
    srv = server_factory("--l1-size-gb", "0.05", http=True)
    run = cli("ping", "--url", srv.url, "--http-url", srv.http_url, "--json")
    assert run.code == 0, run.err
    assert run.json()["http"]["healthy"] is True and run.json()["http"]["status"] == 200
    only_http = cli("ping", "--url", srv.http_url, "--json")
    assert only_http.code == 0 and "zmq" not in only_http.json()


def test_ping_refused(cli: CLI, refused_port: int) -> None:
    run = cli("ping", "--url", f"tcp://127.0.0.1:{refused_port}")
    assert_one_line_error(run, "connection refused")
    as_json = cli("ping", "--url", f"tcp://127.0.0.1:{refused_port}", "--json")
    assert as_json.code == 1 and as_json.json() == {
        "ok": False,
        "url": f"tcp://127.0.0.1:{refused_port}",
        "reason": f"connection refused at 127.0.0.1:{refused_port}",
    }
    http = cli("ping", "--url", f"http://127.0.0.1:{refused_port}")
    assert_one_line_error(http, "connection refused")


def test_ping_timeout(cli: CLI, silent_port: int) -> None:
    run = cli("ping", "--url", f"tcp://127.0.0.1:{silent_port}", "--timeout", "0.3")
    assert_one_line_error(run, "timeout")


def test_ping_protocol_mismatch(cli: CLI, zmq_impostor) -> None:
    newer = zmq_impostor({"ok": True, "result": {"version": "9.0", "protocol": PROTOCOL_VERSION + 1}})
    assert_one_line_error(cli("ping", "--url", newer), "protocol version mismatch")
    refusing = zmq_impostor({"ok": False, "error": {"code": "BAD_VERSION", "message": "protocol 1 not supported"}})
    assert_one_line_error(cli("ping", "--url", refusing), "protocol version mismatch")


def test_ping_bad_url(cli: CLI) -> None:
    assert_usage_error(cli("ping", "--url", "udp://x:1"), "ping:", "--url", "unsupported url")
    assert_usage_error(cli("ping", "--url", "tcp://127.0.0.1"), "has no port", "tcp://127.0.0.1:PORT")
    assert_usage_error(cli("ping", "--bogus"), "ping:", "No such option")
    assert_usage_error(cli("describe", "--timeout", "-1"), "describe:", "--timeout")


def test_host_port_is_a_tcp_url(cli: CLI, server_factory) -> None:
    srv = server_factory("--l1-size-gb", "0.05", http=True)
    bare = srv.url.removeprefix("tcp://")
    run = cli("ping", "--url", bare, "--http-url", srv.http_url.removeprefix("http://"), "--json", "-c", "2")
    assert run.code == 0, run.err
    assert run.json()["zmq"]["url"] == srv.url and run.json()["http"]["url"] == srv.http_url
    assert run.json()["http"]["count"] == 2 and run.json()["http"]["rtt_ms"] <= run.json()["http"]["rtt_ms_avg"]
    assert cli("describe", "--url", bare, "--json").json()["url"] == srv.url


def test_json_errors_under_every_json(cli: CLI, refused_port: int) -> None:
    url = f"tcp://127.0.0.1:{refused_port}"
    for args in (("describe",), ("query", "--model", "m", "--tokens", "1"), ("top", "--once")):
        run = cli(*args, "--url", url, "--json")
        assert run.code == 1, (args, run.err)
        doc = run.json()
        if args[0] == "top":
            assert doc["instances"][0]["up"] is False
        else:
            assert doc["ok"] is False and "connection refused" in doc["reason"], doc


def test_describe_json_fields(cli: CLI, server) -> None:
    with Client(server.url) as c:
        ks, _ = register(c, model="llama-test", layouts=[tiny_layout()])
        store(c, ks, list(range(600)), lambda chunk, group: bytes([chunk]) * tiny_layout().object_bytes)
        c.call("lookup", keyspace=ks.to_wire(), tokens=bytes(4 * 512))  # a miss: 512 tokens asked, 0 hit
    run = cli("describe", "--url", server.url, "--json")
    assert run.code == 0, run.err
    d = run.json()
    assert d["url"] == server.url and d["protocol"] == PROTOCOL_VERSION
    assert d["l1"]["objects"] == 2 and d["l1"]["used_bytes"] > 0
    assert [e["model"] for e in d["engines"]] == ["llama-test"]
    assert d["counters"]["lookup_tokens"] == 512 and d["counters"]["lookup_hit_tokens"] == 0
    assert d["derived"]["token_hit_rate"] == 0.0 and d["derived"]["engines"] == 1
    assert 0 < d["derived"]["l1_used_fraction"] < 1
    for field in ("config", "sessions", "ops", "errors", "uptime_s"):
        assert field in d


def test_describe_human_and_http(cli: CLI, server_factory) -> None:
    srv = server_factory("--l1-size-gb", "0.05", http=True)
    human = cli("describe", "--url", srv.url)
    assert human.code == 0
    for section in ("kvserver 0.1.0 at", "config", "L1", "counters", "errors", "token hit rate"):
        assert section in human.out
    over_http = cli("describe", "--url", srv.http_url, "--json")
    assert over_http.code == 0, over_http.err
    assert over_http.json()["config"]["port"] == srv.port


def test_describe_unreachable(cli: CLI, refused_port: int) -> None:
    assert_one_line_error(cli("describe", "--url", f"tcp://127.0.0.1:{refused_port}"), "connection refused")
    assert_one_line_error(cli("describe", "--url", f"http://127.0.0.1:{refused_port}", "--json"), "connection refused")

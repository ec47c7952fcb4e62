"""`kvcli clear`, `pin`, `unpin` (ZMQ and HTTP) and `kvcli instances` (through a real coordinator)."""

from __future__ import annotations

from click.testing import CliRunner

from kvtestkit.coordproc import wait_for
from kvcli.main import main
from kvcli_testutil import CLI, Run, assert_one_line_error, assert_usage_error
from kvtestkit.kvhelpers import register, store, tiny_layout
from kvprotocol import Client

TOKENS = list(range(3000, 3000 + 768))


def _seed(server) -> str:
    layout = tiny_layout()
    with Client(server.url) as c:
        ks, _ = register(c, model="m-admin", layouts=[layout])
        store(c, ks, TOKENS, lambda ch, g: bytes(layout.object_bytes))
    return layout.fingerprint


def _l1(server) -> dict:
    with Client(server.url) as c:
        return c.call("describe").result["l1"]


def test_pin_unpin_over_zmq_and_http(cli: CLI, server_factory) -> None:
    srv = server_factory("--l1-size-gb", "0.05", http=True)
    fp = _seed(srv)
    tokens = ",".join(map(str, TOKENS))
    pinned = cli("pin", "--url", srv.url, "--model", "m-admin", "--tokens", tokens, "--json")
    assert pinned.code == 0, pinned.err
    assert pinned.json() == {
        "ok": True,
        "url": srv.url,
        "model": "m-admin",
        "tokens": 768,
        "keyspaces": 1,
        "objects": 3,
    }
    assert _l1(srv)["pinned"] == 3
    unpinned = cli("unpin", "--url", srv.http_url, "--model", "m-admin", "--tokens", tokens, "--layout-fingerprint", fp)
    assert unpinned.code == 0, unpinned.err
    assert f"{srv.http_url}: unpinned 3 objects of 768 tokens (m-admin)" in unpinned.out
    assert _l1(srv)["pinned"] == 0
    nobody = cli("pin", "--url", srv.url, "--model", "nobody", "--tokens", "1", "--json")
    assert nobody.code == 1 and "no engine registered" in nobody.json()["reason"]
    assert_usage_error(cli("pin", "--url", srv.url, "--model", "m"), "pin:", "exactly one of --tokens")


def test_clear_asks_unless_yes(cli: CLI, server_factory) -> None:
    srv = server_factory("--l1-size-gb", "0.05", http=True)
    _seed(srv)
    refused = cli("clear", "--url", srv.url, "--json")  # scripts never get a prompt
    assert refused.code == 1 and "--yes" in refused.json()["reason"]
    declined = Run(CliRunner().invoke(main, ["clear", "--url", srv.url], input="n\n"))
    assert declined.code == 1 and "aborted" in declined.err
    no_answer = Run(CliRunner().invoke(main, ["clear", "--url", srv.url], input=""))
    assert no_answer.code == 1 and "aborted" in no_answer.err
    assert _l1(srv)["objects"] == 3  # nothing removed
    confirmed = Run(CliRunner().invoke(main, ["clear", "--url", srv.url], input="y\n"))
    assert confirmed.code == 0 and "removed 3 objects" in confirmed.out
    _seed(srv)
    done = cli("clear", "--url", srv.url, "--yes", "--json")
    assert done.code == 0 and done.json() == {"ok": True, "url": srv.url, "removed": 3}
    assert _l1(srv)["objects"] == 0
    _seed(srv)
    over_http = cli("clear", "--url", srv.http_url, "-y")
    assert over_http.code == 0 and f"{srv.http_url}: removed 3 objects from L1" in over_http.out


def test_admin_commands_need_the_token(server_factory, tmp_path) -> None:
    srv = server_factory("--l1-size-gb", "0.02", "--api-token", "admin-secret", http=True)
    env = {"KVSERVER_STATE_DIR": str(tmp_path / "none"), "KVSERVER_API_TOKEN": None}
    for url in (srv.url, srv.http_url):
        refused = Run(CliRunner().invoke(main, ["clear", "--url", url, "--yes"], env=env))
        assert_one_line_error(refused, "--token")
        ok = Run(CliRunner().invoke(main, ["clear", "--url", url, "--yes", "--token", "admin-secret"], env=env))
        assert ok.code == 0, ok.err


def test_instances_through_the_coordinator(cli: CLI, server_factory, coordinator_factory, refused_port) -> None:
    coord = coordinator_factory()
    srv = server_factory("--l1-size-gb", "0.02", "--coordinator", coord.url, "--heartbeat-interval", "0.2", http=True)
    wait_for(lambda: any(i["zmq_url"] == srv.url for i in coord.instances()), what="registration")
    run = cli("instances", "--coordinator", coord.url, "--json")
    assert run.code == 0, run.err
    doc = run.json()
    assert doc["ok"] is True and [i["zmq_url"] for i in doc["instances"]] == [srv.url]
    human = cli("instances", "--coordinator", coord.url.removeprefix("http://"))
    assert human.code == 0 and srv.url in human.out and "live" in human.out
    down = cli("instances", "--coordinator", f"127.0.0.1:{refused_port}", "--json")
    assert down.code == 1 and down.json()["ok"] is False and "connection refused" in down.json()["reason"]

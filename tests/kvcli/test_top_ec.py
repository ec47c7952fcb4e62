"""`kvcli top` and `kvcli describe` show the encoder cache apart from KV (a real server, real EC ops)."""

from __future__ import annotations

from kvcli_testutil import CLI
from kvtestkit.kvhelpers import payload
from kvprotocol.kvsum import kvsum64

KEY = {"model": "vlm@0123456789abcdef", "space": "fedcba9876543210"}


def test_top_and_describe_show_ec_apart_from_l1(cli: CLI, server_factory) -> None:  # type: ignore[no-untyped-def]
    srv = server_factory("--l1-size-gb", "0.05", "--ec-size-gb", "0.01")
    with srv.client() as c:
        data = payload(1, 5000)
        r = c.call("ec_store", **KEY, item="img", dtype="uint8", shape=[5000], size=5000, mode="tcp").result
        c.call("ec_commit", [data], store_id=r["store_id"], checksum=kvsum64(data))
        c.call("ec_lookup", **KEY, items=["img", "absent"])
    run = cli("top", "--url", srv.url, "--json", "--interval", "0.1")
    assert run.code == 0, run.err
    view = run.json()["instances"][0]
    assert view["ec_objects"] == 1 and view["ec_used"] >= 5000 and view["ec_hit_rate_total"] == 0.5
    assert view["ec_capacity"] == int(0.01 * (1 << 30)) // 4096 * 4096
    assert view["l1_objects"] == 0 and view["l1_used"] == 0  # the EC object is not in L1
    table = cli("top", "--url", srv.url, "--once", "--interval", "0.1")
    assert table.code == 0 and "1 obj" in table.out
    described = cli("describe", "--url", srv.url)
    assert described.code == 0 and "encoder cache (EC)" in described.out and "1 of 2 items" in described.out

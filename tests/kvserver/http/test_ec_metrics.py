"""/metrics shows the encoder cache apart from KV: kvserver_ec_* series move with EC ops only."""

from __future__ import annotations

import httpx

from kvtestkit.httpkv import parse_metrics, value
from kvtestkit.kvhelpers import payload
from kvprotocol.kvsum import kvsum64

KEY = {"model": "vlm@0123456789abcdef", "space": "fedcba9876543210"}


def test_ec_series_move_with_ec_ops_and_kv_series_do_not(server_factory) -> None:  # type: ignore[no-untyped-def]
    srv = server_factory("--l1-size-gb", "0.05", "--ec-size-gb", "0.01", http=True)

    def scrape() -> dict:  # type: ignore[type-arg]
        return parse_metrics(httpx.get(f"{srv.http_url}/metrics", timeout=5).text)

    before = scrape()
    assert value(before, "kvserver_ec_capacity_bytes") == int(0.01 * (1 << 30)) // 4096 * 4096
    with srv.client() as c:
        data = payload(1, 10_000)
        r = c.call("ec_store", **KEY, item="img", dtype="uint8", shape=[10_000], size=10_000, mode="tcp").result
        c.call("ec_commit", [data], store_id=r["store_id"], checksum=kvsum64(data))
        c.call("ec_lookup", **KEY, items=["img", "other"])
    after = scrape()
    assert value(after, "kvserver_ec_objects") == 1 and value(after, "kvserver_ec_object_bytes") == 10_000
    assert value(after, "kvserver_ec_store_bytes_total") == 10_000
    assert value(after, "kvserver_ec_hits_total") == 1 and value(after, "kvserver_ec_misses_total") == 1
    assert value(after, "kvserver_store_bytes_total", tier="l1") == value(
        before, "kvserver_store_bytes_total", tier="l1"
    )
    assert value(after, "kvserver_objects", tier="l1") == 0  # EC objects are not KV objects
    assert value(after, "kvserver_request_duration_seconds_count", op="ec_commit") == 1

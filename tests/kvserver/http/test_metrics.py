"""/metrics over real HTTP: valid exposition, and values that move exactly as operations happen."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families

from kvtestkit.coordproc import wait_for
from kvtestkit.httpkv import CHUNK, Samples, fill, parse_metrics, prompt, value
from kvtestkit.kvhelpers import lookup, register, retrieve, store, tiny_layout, sid
from kvprotocol import ServerError
from kvserver.http.metrics import tier_stats
from kvtestkit.serverproc import ServerProc, free_port

REQUIRED = (
    "kvserver_lookup_requests_total",
    "kvserver_lookup_tokens_total",
    "kvserver_lookup_hit_tokens_total",
    "kvserver_hash_chunks_total",
    "kvserver_hash_memo_hit_chunks_total",
    "kvserver_store_bytes_total",
    "kvserver_retrieve_bytes_total",
    "kvserver_request_duration_seconds_bucket",
    "kvserver_request_duration_seconds_count",
    "kvserver_request_duration_seconds_sum",
    "kvserver_tier_used_bytes",
    "kvserver_l1_capacity_bytes",
    "kvserver_objects",
    "kvserver_evictions_total",
    "kvserver_leases_active",
    "kvserver_errors_total",
    "kvserver_corrupt_reports_total",
    "kvserver_announced_chunks_total",
    "kvserver_announcement_waits_total",
    "kvserver_build_info",
    "process_cpu_seconds_total",
    "process_resident_memory_bytes",
)


def scrape(srv: ServerProc) -> Samples:
    resp = httpx.get(f"{srv.http_url}/metrics", timeout=5)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain; version=")
    return parse_metrics(resp.text)


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """One server for the module: tests compare scrapes before and after, never absolute counts."""
    proc = ServerProc(
        free_port(),
        ["--l1-size-gb", "0.05", "--chunk-size", str(CHUNK)],
        tmp_path_factory.mktemp("metrics") / "kvserver.log",
        http_port=free_port(),
    ).start()
    yield proc
    proc.stop()


def test_exposition_parses_and_names_every_required_metric(srv: ServerProc) -> None:
    with srv.client() as c:
        c.call("ping")
        with pytest.raises(ServerError):
            c.call("no_such_op")
    samples = scrape(srv)
    names = {name for name, _ in samples}
    assert set(REQUIRED) <= names, set(REQUIRED) - names
    assert value(samples, "kvserver_build_info", version="0.1.0") == 1
    status = httpx.get(f"{srv.http_url}/v1/status", timeout=5).json()
    assert value(samples, "kvserver_l1_capacity_bytes") == status["l1"]["capacity_bytes"]
    # Error counters start at zero for every code, so alerts and rate() have a series from the start.
    assert value(samples, "kvserver_errors_total", code="NO_SPACE") == status["errors"].get("NO_SPACE", 0)
    assert value(samples, "kvserver_errors_total", code="UNKNOWN_OP") >= 1
    # No series repeats another: each (name, labels) once in the text, and L1 bytes only per tier.
    text = httpx.get(f"{srv.http_url}/metrics", timeout=5).text
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert len(lines) == len(parse_metrics(text))
    assert "kvserver_l1_used_bytes" not in text
    om = httpx.get(
        f"{srv.http_url}/metrics", timeout=5, headers={"Accept": "application/openmetrics-text; version=1.0.0"}
    )
    assert om.headers["content-type"].startswith("application/openmetrics-text")
    om_names = {s.name for f in openmetrics_families(om.text) for s in f.samples}
    assert "kvserver_lookup_hit_tokens_total" in om_names
    bounded = {"op", "tier", "code", "version", "le", "route", "status", "tenant", "found"}  # found: 2 values
    for name, labels in samples:  # bounded labels only (tenant: operator-chosen names, at most 64)
        assert {k for k, _ in labels} <= bounded, name


def test_values_move_exactly_with_operations(srv: ServerProc) -> None:
    tokens = prompt(3, tail=7)
    with srv.client() as c:
        ks, _ = register(c, model="m-move", layouts=[tiny_layout(CHUNK)])
        m0 = scrape(srv)
        assert lookup(c, ks, tokens) == 0  # a miss: tokens asked, none hit
        m1 = scrape(srv)
        assert value(m1, "kvserver_lookup_requests_total") == value(m0, "kvserver_lookup_requests_total") + 1
        assert value(m1, "kvserver_lookup_tokens_total") == value(m0, "kvserver_lookup_tokens_total") + len(tokens)
        assert value(m1, "kvserver_lookup_hit_tokens_total") == value(m0, "kvserver_lookup_hit_tokens_total")

        store(c, ks, tokens[: 2 * CHUNK], fill)
        m2 = scrape(srv)
        assert (
            value(m2, "kvserver_store_bytes_total", tier="l1")
            == value(m1, "kvserver_store_bytes_total", tier="l1") + 2 * 2048
        )
        assert value(m2, "kvserver_objects", tier="l1") == value(m1, "kvserver_objects", tier="l1") + 2
        used_before = value(m1, "kvserver_tier_used_bytes", tier="l1")
        assert value(m2, "kvserver_tier_used_bytes", tier="l1") >= used_before + 2 * 2048

        hit = lookup(c, ks, tokens, session=sid("s1"))
        assert hit == 2 * CHUNK
        m3 = scrape(srv)
        assert value(m3, "kvserver_lookup_hit_tokens_total") == value(m2, "kvserver_lookup_hit_tokens_total") + hit
        assert value(m3, "kvserver_lookup_tokens_total") == value(m2, "kvserver_lookup_tokens_total") + len(tokens)
        assert value(m3, "kvserver_leases_active") == value(m2, "kvserver_leases_active") + 2

        got = retrieve(c, "s1", 0, 2)
        m4 = scrape(srv)
        assert value(m4, "kvserver_retrieve_bytes_total", tier="l1") == value(
            m3, "kvserver_retrieve_bytes_total", tier="l1"
        ) + sum(len(b) for b in got.values())
        c.call("end_session", session=sid("s1"))
        assert value(scrape(srv), "kvserver_leases_active") == value(m2, "kvserver_leases_active")

        for bad in ("bogus_a", "bogus_b"):
            with pytest.raises(ServerError):
                c.call(bad)
        m5 = scrape(srv)
        assert (
            value(m5, "kvserver_errors_total", code="UNKNOWN_OP")
            == value(m4, "kvserver_errors_total", code="UNKNOWN_OP") + 2
        )
        assert (
            value(m5, "kvserver_request_duration_seconds_count", op="lookup")
            == value(m0, "kvserver_request_duration_seconds_count", op="lookup") + 2
        )
        assert value(m5, "kvserver_request_duration_seconds_count", op="invalid") >= 2


def test_evictions_are_counted(server_factory) -> None:
    srv = server_factory("--l1-size-gb", "0.001", "--chunk-size", str(CHUNK), http=True)  # 1 MiB arena
    big = tiny_layout(CHUNK, block_bytes=64 << 10)  # 128 KiB objects: 8 fit
    with srv.client() as c:
        ks, _ = register(c, layouts=[big])
        store(c, ks, prompt(6, seed=1), lambda ch, g: bytes(big.object_bytes))
        store(c, ks, prompt(6, seed=2), lambda ch, g: bytes(big.object_bytes))
        status = c.call("describe").result
    samples = scrape(srv)
    assert status["l1"]["evictions"] > 0
    assert value(samples, "kvserver_evictions_total", tier="l1") == status["l1"]["evictions"]
    assert value(samples, "kvserver_objects", tier="l1") == status["l1"]["objects"]


def test_http_requests_are_counted_by_route_template(srv: ServerProc) -> None:
    before = scrape(srv)
    with srv.http(timeout=5) as h:
        for _ in range(3):
            h.get("/healthz")
        h.get("/no/such/path/12345")
    samples = scrape(srv)
    for route, status, n in (("/healthz", "200", 3), ("unmatched", "404", 1), ("/metrics", "200", 1)):
        assert (
            value(samples, "kvserver_http_requests_total", route=route, status=status)
            == value(before, "kvserver_http_requests_total", route=route, status=status) + n
        )
    assert not any("12345" in v for _, labels in samples for _, v in labels)


def test_tier_stats_read_l2_tiers_from_describe() -> None:
    described = {
        "l1": {"objects": 4, "used_bytes": 8192, "evictions": 1},
        "counters": {"stored_bytes": 100, "retrieved_bytes": 50},
        "l2": [
            {
                "tier": "fs",
                "objects": 9,
                "bytes": 900,
                "put_bytes": 700,
                "get_bytes": 300,
                "evictions": 2,
                "up": True,
                "hits": 4,
            },
            {"tier": "fs", "objects": 1},  # duplicate name: made unique
            {"tier": "redis://:secret@host:6379/0", "objects": 5},  # unsafe name: never a label
            {"name": "fs", "used_bytes": 7, "stored_bytes": 7},  # keys no tier describes: nothing read
            "not a map",
        ],
    }
    tiers = {t.tier: t for t in tier_stats(described)}
    assert set(tiers) == {"l1", "fs", "l2.1", "l2.2", "l2.3"}
    assert tiers["l1"].store_bytes == 100 and tiers["l1"].retrieve_bytes == 50 and tiers["l1"].objects == 4
    assert tiers["fs"].store_bytes == 700 and tiers["fs"].retrieve_bytes == 300 and tiers["fs"].used_bytes == 900
    assert tiers["fs"].up == 1.0 and tiers["fs"].hits == 4 and tiers["l1"].up is None
    assert tiers["l2.1"].objects == 1 and tiers["l2.1"].store_bytes is None
    assert tiers["l2.2"].objects == 5
    assert tiers["l2.3"].used_bytes is None and tiers["l2.3"].store_bytes is None


def test_l2_tier_series_come_from_a_real_fs_tier(server_factory, tmp_path) -> None:
    srv = server_factory(
        "--l1-size-gb", "0.05", "--chunk-size", str(CHUNK), "--l2", f"fs://{tmp_path / 'l2'}", http=True
    )
    with srv.client() as c:
        ks, _ = register(c, layouts=[tiny_layout(CHUNK)])
        store(c, ks, prompt(2), fill)

    def written() -> Samples | None:
        samples = scrape(srv)
        return samples if value(samples, "kvserver_store_bytes_total", tier="fs") > 0 else None

    samples = wait_for(written, what="write-behind to the fs tier")
    [fs] = httpx.get(f"{srv.http_url}/v1/status", timeout=5).json()["l2"]
    assert value(samples, "kvserver_store_bytes_total", tier="fs") <= fs["put_bytes"]  # scraped first
    assert value(samples, "kvserver_store_bytes_total", tier="l1") == 2 * 2048
    assert value(samples, "kvserver_l2_up", tier="fs") == 1
    assert ("kvserver_l2_queue_capacity", frozenset()) in samples
    assert value(samples, "kvserver_l2_admitted_total") == 2  # admission "all": both objects
    assert value(samples, "kvserver_l2_retried_total", tier="fs") == 0
    assert ("kvserver_l2_negative_cache_hits_total", frozenset()) in samples
    assert not any(dict(labels).get("tier", "").startswith("fs:") for _, labels in samples)  # no URLs

"""The shipped alert rules and Grafana dashboard, checked with promtool and against a real Prometheus
that scrapes a real kvserver (with an L2 tier) and a real coordinator under load: every dashboard
query and every alert expression evaluates without error and returns series."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvtestkit.coordproc import CoordinatorFactory, wait_for
from kvtestkit.httpkv import CHUNK, prompt
from kvtestkit.kvhelpers import lookup, register, store, tiny_layout
from kvprotocol import ServerError, resolve_token
from kvtestkit.serverproc import ManagedProcess, free_port

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "kvserver-alerts.yaml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "kvserver-alerts.test.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "kvserver-dashboard.json"
needs_prometheus = pytest.mark.skipif(
    shutil.which("prometheus") is None or shutil.which("promtool") is None,
    reason="prometheus/promtool (Debian: prometheus) are missing",
)
_COMPARISON = re.compile(r" (==|!=|>=|<=|>|<) (?!.* (==|!=|>=|<=|>|<) )")


def alert_exprs() -> dict[str, str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {r["alert"]: " ".join(r["expr"].split()) for g in groups for r in g["rules"]}


def dashboard_exprs() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [t["expr"] for p in panels for t in p["targets"]]


def as_bool(expr: str) -> str:
    """`A > 0.5` filters series away when healthy; `A > bool 0.5` keeps them (as 0/1), so an empty
    answer can only mean a missing series."""
    out, n = _COMPARISON.subn(r" \1 bool ", expr, count=1)
    assert n == 1, f"alert expression without a top-level comparison: {expr}"
    return out


def grafana_to_promql(expr: str) -> str:
    return expr.replace("$__rate_interval", "30s").replace('"$instance"', '".*"')


@needs_prometheus
def test_alert_rules_pass_promtool_check_and_unit_tests() -> None:
    check = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"{len(alert_exprs())} rules found" in check.stdout
    unit = subprocess.run(
        ["promtool", "test", "rules", RULE_TESTS.name],
        cwd=RULE_TESTS.parent,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert unit.returncode == 0, unit.stdout + unit.stderr
    tested = set(re.findall(r"alertname: (\w+)", RULE_TESTS.read_text()))
    assert tested == set(alert_exprs()), "every alert has a unit test"


def test_as_bool_rewrites_only_the_top_level_comparison() -> None:
    assert as_bool('sum(rate(x{code!="A"}[5m])) / y > 0.05') == 'sum(rate(x{code!="A"}[5m])) / y > bool 0.05'
    assert as_bool("a < 0.5 * (b)") == "a < bool 0.5 * (b)"
    with pytest.raises(AssertionError):
        as_bool("sum(x)")


class PrometheusProc(ManagedProcess):
    def __init__(self, config: Path, data: Path, log_path: Path) -> None:
        self.port, self.config, self.data, self.log_path, self.proc = free_port(), config, data, log_path, None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> PrometheusProc:
        self.spawn(
            [
                "prometheus",
                f"--config.file={self.config}",
                f"--storage.tsdb.path={self.data}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            env={},
        )

        def ready() -> bool:
            assert self.proc is not None and self.proc.poll() is None, self.log()
            try:
                return httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, timeout=30, what="prometheus ready")
        return self

    def query(self, expr: str) -> list[Any]:
        body = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10).json()
        assert body["status"] == "success", (expr, body)
        return list(body["data"]["result"])


@pytest.fixture
def prometheus(
    tmp_path: Path, server_factory: Any, coordinator_factory: CoordinatorFactory
) -> Iterator[tuple[PrometheusProc, Any]]:
    coordinator = coordinator_factory()
    srv = server_factory(
        "--l1-size-gb",
        "0.001",
        "--chunk-size",
        str(CHUNK),
        "--l2",
        f"fs://{tmp_path / 'l2'}",
        "--coordinator",
        coordinator.url,
        "--heartbeat-interval",
        "0.5",
        http=True,
    )
    token_file = tmp_path / "kvserver-token"
    token_file.write_text(resolve_token(srv.token, srv.http_url) or "")
    config = tmp_path / "prometheus.yml"
    config.write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": [str(RULES)],
                "scrape_configs": [
                    {  # with the server's token, as deploy/compose/prometheus.yml: per-tenant series too
                        "job_name": "kvserver",
                        "authorization": {"credentials_file": str(token_file)},
                        "static_configs": [{"targets": [srv.http_url.removeprefix("http://")]}],
                    },
                    {
                        "job_name": "kvcoordinator",
                        "static_configs": [{"targets": [coordinator.url.removeprefix("http://")]}],
                    },
                ],
            }
        )
    )
    prom = PrometheusProc(config, tmp_path / "tsdb", tmp_path / "prometheus.log").start()
    yield prom, srv
    prom.stop()


def _load(srv: Any, seconds: float) -> None:
    """Stores that evict, lookups that hit and miss, and refused requests, for a few scrapes."""
    big = tiny_layout(CHUNK, block_bytes=16 << 10)  # 32 KiB objects in a 1 MiB arena: evictions
    with srv.client() as c:
        ks, _ = register(c, layouts=[big])
        deadline, seed = time.monotonic() + seconds, 0
        while time.monotonic() < deadline:
            seed += 1
            tokens = prompt(4, seed=seed)
            store(c, ks, tokens, lambda ch, g: bytes(big.object_bytes))
            lookup(c, ks, tokens)
            lookup(c, ks, prompt(4, seed=10_000 + seed))
            with pytest.raises(ServerError):
                c.call("no_such_op")
            time.sleep(0.05)


@needs_prometheus
def test_dashboard_and_alert_queries_return_data_from_a_real_prometheus(prometheus: Any) -> None:
    prom, srv = prometheus
    _load(srv, seconds=6)
    wait_for(
        lambda: prom.query("rate(kvserver_lookup_requests_total[30s]) > 0"),
        timeout=20,
        what="two scrapes of a busy kvserver",
    )
    # increase()/rate() need two samples in their window: wait for two scrapes of each target, or an
    # alert over a counter reads nothing yet (CI once failed on KVCoordinatorInstanceLost this way).
    wait_for(
        lambda: prom.query('count_over_time(up{job="kvcoordinator"}[1m]) >= 2'),
        timeout=20,
        what="two coordinator scrapes",
    )
    # the scrape sends the server's token: per-tenant series arrive (a token-less one gets aggregates only)
    assert prom.query('kvserver_tenant_lookup_requests_total{job="kvserver"}')
    for expr in dashboard_exprs():
        assert prom.query(grafana_to_promql(expr)), f"dashboard query returned nothing: {expr}"
    for name, expr in alert_exprs().items():
        assert prom.query(as_bool(expr)), f"alert {name} reads series that do not exist: {expr}"

    def evaluated() -> list[dict[str, Any]] | None:
        groups = httpx.get(f"{prom.url}/api/v1/rules", timeout=10).json()["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        return rules if rules and all(r.get("lastEvaluation", "").startswith("20") for r in rules) else None

    rules = wait_for(evaluated, timeout=20, what="one evaluation of every rule")
    assert {r["name"] for r in rules} == set(alert_exprs())
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]

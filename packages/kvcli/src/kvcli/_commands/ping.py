"""`kvcli ping`: is the server there, how far away, and does it speak our protocol version."""

from __future__ import annotations

import time
from typing import Any

import click

from .._output import emit_json, fail
from .._source import DEFAULT_URL, Unreachable, check_url, http_get, fail_fast, is_http, zmq_call


def ping_zmq(url: str, timeout: float, count: int) -> dict[str, Any]:
    from kvprotocol import PROTOCOL_VERSION, Client

    rtts = []
    result: dict[str, Any] = {}
    fail_fast(url, timeout)
    with Client(url, timeout=timeout) as client:
        for _ in range(count):
            t0 = time.perf_counter()
            result = zmq_call(client, "ping", timeout)
            rtts.append(time.perf_counter() - t0)
    if result.get("protocol") != PROTOCOL_VERSION:
        raise Unreachable(f"protocol version mismatch: server speaks {result.get('protocol')!r}, "
                          f"kvcli speaks {PROTOCOL_VERSION}")
    return {"url": url, "version": result.get("version"), "protocol": result.get("protocol"),
            "rtt_ms": round(1000 * min(rtts), 3), "rtt_ms_avg": round(1000 * sum(rtts) / len(rtts), 3),
            "count": count}


def ping_http(url: str, timeout: float) -> dict[str, Any]:
    status, body, elapsed = http_get(url, "/healthz", timeout)
    out: dict[str, Any] = {"url": url, "status": status, "rtt_ms": round(1000 * elapsed, 3),
                           "healthy": status == 200}
    if isinstance(body, dict):
        out["body"] = body
    if status != 200:
        raise Unreachable(f"unhealthy: GET /healthz answered HTTP {status}")
    return out


@click.command(name="ping")
@click.option("--url", default=DEFAULT_URL, show_default=True,
              help="Server url: tcp:// or ipc:// (ZMQ ping) or http(s):// (HTTP /healthz).")
@click.option("--http-url", default=None, help="Also check HTTP health at this admin url.")
@click.option("--timeout", default=2.0, show_default=True, type=float, help="Seconds to wait for each answer.")
@click.option("-c", "--count", default=1, show_default=True, type=click.IntRange(1, 1000),
              help="ZMQ round trips to measure (the minimum is reported).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def command(url: str, http_url: str | None, timeout: float, count: int, as_json: bool) -> None:
    """Round-trip time and version of a kvserver; exit 0 healthy, 1 unreachable or unhealthy."""
    report: dict[str, Any] = {"ok": True}
    try:
        if is_http(check_url(url)):
            report["http"] = ping_http(url, timeout)
        else:
            report["zmq"] = ping_zmq(url, timeout, count)
            if http_url:
                report["http"] = ping_http(check_url(http_url), timeout)
    except Unreachable as exc:
        if as_json:
            emit_json({**report, "ok": False, "url": url, "reason": str(exc)})
        fail(str(exc))
    if as_json:
        emit_json(report)
        return
    if "zmq" in report:
        z = report["zmq"]
        click.echo(f"{z['url']}: kvserver {z['version']} protocol {z['protocol']} rtt {z['rtt_ms']:.3f} ms")
    if "http" in report:
        h = report["http"]
        click.echo(f"{h['url']}: healthy (HTTP {h['status']}) rtt {h['rtt_ms']:.3f} ms")

"""`kvcli ping`: is the server there, how far away, and does it speak our protocol version."""

from __future__ import annotations

import time
from typing import Any

import click

from .._auth import cli_token, token_options
from .._output import emit_json, fail
from .._source import DEFAULT_URL, HTTP_URL, URL, Unreachable, fail_fast, http_get, is_http, zmq_call


def ping_zmq(url: str, timeout: float, count: int) -> dict[str, Any]:
    from kvprotocol import PROTOCOL_VERSION, Client

    rtts = []
    result: dict[str, Any] = {}
    fail_fast(url, timeout)
    with Client(url, timeout=timeout, token=cli_token()) as client:
        for _ in range(count):
            t0 = time.perf_counter()
            result = zmq_call(client, "ping", timeout)
            rtts.append(time.perf_counter() - t0)
    if result.get("protocol") != PROTOCOL_VERSION:
        raise Unreachable(
            f"protocol version mismatch: server speaks {result.get('protocol')!r}, kvcli speaks {PROTOCOL_VERSION}"
        )
    return {
        "url": url,
        "version": result.get("version"),
        "protocol": result.get("protocol"),
        "rtt_ms": round(1000 * min(rtts), 3),
        "rtt_ms_avg": round(1000 * sum(rtts) / len(rtts), 3),
        "count": count,
    }


def ping_http(url: str, timeout: float, count: int = 1) -> dict[str, Any]:
    """GET /healthz `count` times on one reused client: the rtt is the request's, not the client's set-up."""
    rtts = []
    status, body = 0, None
    for _ in range(count):
        status, body, elapsed = http_get(url, "/healthz", timeout)
        rtts.append(elapsed)
    out: dict[str, Any] = {
        "url": url,
        "status": status,
        "rtt_ms": round(1000 * min(rtts), 3),
        "rtt_ms_avg": round(1000 * sum(rtts) / len(rtts), 3),
        "count": count,
        "healthy": status == 200,
    }
    if isinstance(body, dict):
        out["body"] = body
    if status != 200:
        raise Unreachable(f"unhealthy: GET /healthz answered HTTP {status}")
    return out


@click.command(name="ping")
@click.option(
    "--url",
    type=URL,
    default=DEFAULT_URL,
    show_default=True,
    help="Server: host:port or tcp://host:port or ipc://path (ZMQ ping), http(s):// (HTTP /healthz).",
)
@click.option("--http-url", type=HTTP_URL, default=None, help="Also check HTTP health at this admin url.")
@click.option(
    "--timeout",
    default=2.0,
    show_default=True,
    type=click.FloatRange(0.01, 3600),
    help="Seconds to wait for each answer.",
)
@click.option(
    "-c",
    "--count",
    default=1,
    show_default=True,
    type=click.IntRange(1, 1000),
    help="Round trips to measure (the minimum is reported).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (also on failure: ok false and the reason).")
@token_options
def command(url: str, http_url: str | None, timeout: float, count: int, as_json: bool) -> None:
    """Round-trip time and version of a kvserver; exit 0 healthy, 1 unreachable or unhealthy."""
    report: dict[str, Any] = {"ok": True}
    try:
        if is_http(url):
            report["http"] = ping_http(url, timeout, count)
        else:
            report["zmq"] = ping_zmq(url, timeout, count)
            if http_url:
                report["http"] = ping_http(http_url, timeout, count)
    except Unreachable as exc:
        fail(str(exc), as_json, url=url, **{k: v for k, v in report.items() if k != "ok"})
    if as_json:
        emit_json(report)
        return
    if "zmq" in report:
        z = report["zmq"]
        click.echo(f"{z['url']}: kvserver {z['version']} protocol {z['protocol']} rtt {z['rtt_ms']:.3f} ms")
    if "http" in report:
        h = report["http"]
        click.echo(f"{h['url']}: healthy (HTTP {h['status']}) rtt {h['rtt_ms']:.3f} ms")

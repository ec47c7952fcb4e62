"""`kvcli instances`: the kvservers registered with a coordinator (GET /v1/instances)."""

from __future__ import annotations

from typing import Any

import click

from .._auth import token_options
from .._output import emit_json, fail, human_bytes, stdout_console
from .._source import HTTP_URL, Unreachable, http_json

DEFAULT_COORDINATOR = "http://127.0.0.1:9090"


def render(body: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(
        title=f"{len(body['instances'])} instances (timeout {body.get('instance_timeout', '-')} s)",
        title_justify="left",
    )
    for col in ("id", "zmq", "http", "liveness", "last beat", "L1 used", "objects", "models"):
        table.add_column(
            col,
            justify="right" if col in ("last beat", "L1 used", "objects") else "left",
            no_wrap=col in ("zmq", "http"),
        )
    for inst in body["instances"]:
        table.add_row(
            str(inst.get("id", "?"))[:12],
            str(inst.get("zmq_url") or "-"),
            str(inst.get("http_url") or "-"),
            str(inst.get("liveness", "?")),
            f"{inst.get('seconds_since_heartbeat', 0):.1f}s",
            human_bytes(inst.get("l1_used_bytes")),
            str(inst.get("objects", "-")),
            ",".join(inst.get("models") or []) or "-",
        )
    return table


@click.command(name="instances")
@click.option(
    "--coordinator",
    "url",
    type=HTTP_URL,
    default=DEFAULT_COORDINATOR,
    show_default=True,
    help="Coordinator url (http://host:port, or host:port).",
)
@click.option("--timeout", default=5.0, show_default=True, type=click.FloatRange(0.01, 3600))
@click.option("--json", "as_json", is_flag=True, help="Print JSON (also on failure: ok false and the reason).")
@token_options
def command(url: str, timeout: float, as_json: bool) -> None:
    """Instances registered with a coordinator: addresses, liveness, last heartbeat, L1 use, models."""
    try:
        body = http_json(url, "/v1/instances", timeout)
    except Unreachable as exc:
        fail(str(exc), as_json, coordinator=url)
    if not isinstance(body, dict) or not isinstance(body.get("instances"), list):
        fail("the coordinator's /v1/instances answer has no instance list", as_json, coordinator=url)
    if as_json:
        emit_json({"ok": True, "coordinator": url, **body})
        return
    stdout_console(150).print(render(body))

"""Ask every live instance at once, with one bounded timeout: fleet status and fleet lookup.

An instance that does not answer in time, refuses, or answers an error is reported as such; it
never fails the whole request or delays it beyond the timeout.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx

from .credentials import InstanceCredentials
from .registry import Instance

Outcome = Callable[[str, str], None]  # (endpoint, outcome) -> metrics


async def _call(
    client: httpx.AsyncClient,
    creds: InstanceCredentials,
    inst: Instance,
    method: str,
    path: str,
    timeout: float,
    body: Any = None,
) -> tuple[Any, str | None]:
    """(json reply, None) or (None, why it failed)."""
    if not inst.http_url:
        return None, "no http url registered (server runs with --http-port 0)"
    try:
        resp = await client.request(
            method,
            inst.http_url.rstrip("/") + path,
            json=body,
            timeout=timeout,
            headers=creds.headers_for(inst.http_url),
        )
    except httpx.TimeoutException:
        return None, f"timeout after {timeout:g}s"
    except httpx.HTTPError as exc:
        return None, f"unreachable: {type(exc).__name__}: {str(exc)[:200]}"
    if resp.status_code != 200:
        try:
            detail = resp.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            detail = resp.reason_phrase
        return None, f"HTTP {resp.status_code}: {str(detail)[:200]}"
    try:
        return resp.json(), None
    except ValueError:
        return None, "answer is not JSON"


def _kind(error: str | None) -> str:
    if error is None:
        return "ok"
    return "timeout" if error.startswith("timeout") else "error"


async def fleet_status(
    client: httpx.AsyncClient, creds: InstanceCredentials, instances: list[Instance], timeout: float, outcome: Outcome
) -> list[tuple[Instance, dict[str, Any] | None, str | None]]:
    replies = await asyncio.gather(*(_call(client, creds, i, "GET", "/v1/status", timeout) for i in instances))
    out = []
    for inst, (body, error) in zip(instances, replies, strict=True):
        outcome("status", _kind(error))
        out.append((inst, body if isinstance(body, dict) else None, error))
    return out


async def fleet_query(
    client: httpx.AsyncClient,
    creds: InstanceCredentials,
    instances: list[Instance],
    body: dict[str, Any],
    timeout: float,
    outcome: Outcome,
) -> list[tuple[Instance, int | None, str | None]]:
    """Each instance's reusable prefix (tokens) for the body, or why it could not say."""
    replies = await asyncio.gather(*(_call(client, creds, i, "POST", "/v1/query", timeout, body) for i in instances))
    out: list[tuple[Instance, int | None, str | None]] = []
    for inst, (reply, error) in zip(instances, replies, strict=True):
        prefix = reply.get("prefix_tokens") if isinstance(reply, dict) else None
        if error is None and not isinstance(prefix, int):
            error = "answer has no prefix_tokens"
        outcome("query", _kind(error))
        out.append((inst, prefix if error is None else None, error))
    return out


def summarize(results: list[tuple[Instance, dict[str, Any] | None, str | None]]) -> dict[str, Any]:
    """Fleet totals over the instances that answered."""
    total: dict[str, Any] = {
        "instances": len(results),
        "reachable": 0,
        "l1_capacity_bytes": 0,
        "l1_used_bytes": 0,
        "objects": 0,
        "lookup_tokens": 0,
        "lookup_hit_tokens": 0,
    }
    for _inst, status, _error in results:
        if status is None:
            continue
        total["reachable"] += 1
        l1, counters = status.get("l1", {}), status.get("counters", {})
        for key in ("capacity_bytes", "used_bytes", "objects"):
            name = key if key == "objects" else f"l1_{key}"
            total[name] += int(l1.get(key, 0) or 0)
        total["lookup_tokens"] += int(counters.get("lookup_tokens", 0) or 0)
        total["lookup_hit_tokens"] += int(counters.get("lookup_hit_tokens", 0) or 0)
    total["unreachable"] = total["instances"] - total["reachable"]
    total["token_hit_rate"] = (
        round(total["lookup_hit_tokens"] / total["lookup_tokens"], 6) if total["lookup_tokens"] else None
    )
    return total

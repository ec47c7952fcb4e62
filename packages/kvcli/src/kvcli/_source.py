"""Reaching servers: ZMQ calls and HTTP GETs that fail with a one-line, operator-readable reason.

A ZMQ DEALER never reports a refused connection (it just waits), so before blaming a timeout we
probe the TCP port: "connection refused" and "timeout" are different problems for an operator.
"""

from __future__ import annotations

import socket
import time
from typing import Any
from urllib.parse import urlparse

from kvprotocol import DEFAULT_URL as DEFAULT_URL  # re-exported for the commands


class Unreachable(Exception):
    """The server could not be used; str() is the one-line reason."""


def is_http(url: str) -> bool:
    return url.startswith(("http://", "https://"))


def check_url(url: str) -> str:
    if is_http(url) or url.startswith(("tcp://", "ipc://")):
        return url
    raise Unreachable(f"unsupported url {url!r} (expected tcp://, ipc://, http:// or https://)")


def tcp_probe(url: str, timeout: float) -> str | None:
    """None when something accepts connections at the url's host:port, else why not."""
    parsed = urlparse(url)
    if parsed.scheme not in ("tcp", "http", "https") or not parsed.hostname:
        return None
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname, port), timeout=timeout):
            return None
    except ConnectionRefusedError:
        return f"connection refused at {parsed.hostname}:{port}"
    except TimeoutError:
        return f"timeout connecting to {parsed.hostname}:{port}"
    except OSError as exc:
        return f"cannot connect to {parsed.hostname}:{port}: {exc.strerror or exc}"


def fail_fast(url: str, timeout: float) -> None:
    """Raise Unreachable at once when nothing listens, instead of waiting out a ZMQ timeout."""
    reason = tcp_probe(url, min(timeout, 1.0))
    if reason:
        raise Unreachable(reason)


def _explain(exc: Exception, op: str, url: str, timeout: float) -> Unreachable:
    from kvprotocol import ErrorCode, RequestTimeout, ServerError

    if isinstance(exc, RequestTimeout):
        return Unreachable(tcp_probe(url, min(timeout, 1.0)) or f"timeout: no reply to {op} from {url} in {timeout:g}s")
    if isinstance(exc, ServerError) and exc.code == ErrorCode.BAD_VERSION:
        return Unreachable(f"protocol version mismatch: {exc.message}")
    if isinstance(exc, ServerError):
        return Unreachable(f"{op} failed: {exc.code}: {exc.message}")
    return Unreachable(f"{op} failed: {exc}")


def zmq_call(client: Any, op: str, timeout: float, **fields: Any) -> Any:
    """`client.call(op)` that raises Unreachable with a reason instead of protocol exceptions."""
    from kvprotocol import KVProtocolError

    try:
        return client.call(op, timeout=timeout, **fields).result
    except KVProtocolError as exc:
        raise _explain(exc, op, client.url, timeout) from None


def zmq_request(url: str, op: str, timeout: float, **fields: Any) -> tuple[Any, float]:
    """One call on a fresh client: (result, round-trip seconds)."""
    from kvprotocol import Client

    fail_fast(url, timeout)
    with Client(check_url(url), timeout=timeout) as client:
        t0 = time.perf_counter()
        result = zmq_call(client, op, timeout, **fields)
        return result, time.perf_counter() - t0


def http_get(url: str, path: str, timeout: float) -> tuple[int, Any, float]:
    """GET url+path: (status, parsed JSON or text, seconds); Unreachable when no answer came."""
    import httpx

    full = url.rstrip("/") + path
    t0 = time.perf_counter()
    try:
        resp = httpx.get(full, timeout=timeout, headers=auth_headers(url), trust_env=False)
    except httpx.ConnectError:
        raise Unreachable(tcp_probe(url, min(timeout, 1.0)) or f"cannot connect to {url}") from None
    except httpx.TimeoutException:
        raise Unreachable(f"timeout: no answer from {full} in {timeout:g}s") from None
    except httpx.HTTPError as exc:
        raise Unreachable(f"HTTP error from {full}: {exc}") from None
    elapsed = time.perf_counter() - t0
    try:
        body: Any = resp.json()
    except ValueError:
        body = resp.text
    return resp.status_code, body, elapsed


def auth_headers(url: str) -> dict[str, str]:
    """Bearer token found as every client finds it: $KVSERVER_API_TOKEN, $KVSERVER_API_TOKEN_FILE, or
    the server's default token file for a loopback URL (see kvprotocol._credentials)."""
    from kvprotocol import resolve_token

    token = resolve_token(None, url)
    return {"Authorization": f"Bearer {token}"} if token else {}


def http_json(url: str, path: str, timeout: float) -> Any:
    status, body, _ = http_get(url, path, timeout)
    if status in (401, 403):
        raise Unreachable(f"GET {path} answered HTTP {status}: set KVSERVER_API_TOKEN to the server's API token")
    if status != 200:
        raise Unreachable(f"GET {path} answered HTTP {status}")
    if not isinstance(body, (dict, list)):
        raise Unreachable(f"GET {path} did not answer JSON")
    return body


def fetch_status(url: str, timeout: float) -> dict[str, Any]:
    """The server's describe() map, over ZMQ (tcp://, ipc://) or HTTP (/v1/status)."""
    if is_http(check_url(url)):
        body = http_json(url, "/v1/status", timeout)
    else:
        body, _ = zmq_request(url, "describe", timeout)
    if not isinstance(body, dict):
        raise Unreachable("status is not a map")
    return body

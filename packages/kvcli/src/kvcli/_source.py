"""Reaching servers: ZMQ calls and HTTP GETs that fail with a one-line, operator-readable reason.

A ZMQ DEALER never reports a refused connection (it just waits), so before blaming a timeout we
probe the TCP port: "connection refused" and "timeout" are different problems for an operator.
"""

from __future__ import annotations

import re
import socket
import time
from typing import Any
from urllib.parse import urlparse

import click
from kvprotocol import DEFAULT_URL as DEFAULT_URL  # re-exported for the commands

from ._auth import cli_token, token_for

_HOST_PORT = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")


class Unreachable(Exception):
    """The server could not be used; str() is the one-line reason."""


class AuthRejected(Unreachable):
    """The server answered but refused the credential (HTTP 401/403, ZMQ UNAUTHORIZED/FORBIDDEN)."""


def is_http(url: str) -> bool:
    return url.startswith(("http://", "https://"))


def check_url(url: str, bare: str = "tcp") -> str:
    """The url in canonical form: `host:port` becomes `<bare>://host:port`; a tcp url needs its port.

    Raises Unreachable with the reason (never guesses a port: `tcp://host` is not port 80).
    """
    url = url.strip()
    if _HOST_PORT.match(url):
        url = f"{bare}://{url}"
    if url.startswith("ipc://"):
        if len(url) == len("ipc://"):
            raise Unreachable("ipc:// url without a path (expected ipc:///path/to/socket)")
        return url
    if not (is_http(url) or url.startswith("tcp://")):
        raise Unreachable(
            f"unsupported url {url!r} (expected host:port, tcp://host:port, ipc://path, http(s)://host:port)"
        )
    try:
        parsed = urlparse(url)
        port = parsed.port
    except ValueError as exc:
        raise Unreachable(f"bad url {url!r}: {exc}") from None
    if not parsed.hostname:
        raise Unreachable(f"url {url!r} has no host")
    if url.startswith("tcp://") and port is None:
        raise Unreachable(
            f"url {url!r} has no port: give tcp://{parsed.hostname}:PORT (the server's --port, 5555 by default)"
        )
    return url


class URLType(click.ParamType):
    """A --url value checked and normalised at parse time (a bad one is a one-line usage error)."""

    name = "URL"

    def __init__(self, bare: str = "tcp") -> None:
        self.bare = bare

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        try:
            return check_url(str(value), self.bare)
        except Unreachable as exc:
            self.fail(str(exc), param, ctx)


URL = URLType()
HTTP_URL = URLType("http")  # admin and coordinator urls: a bare host:port means http://


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
    if isinstance(exc, ServerError) and exc.code in (ErrorCode.UNAUTHORIZED, ErrorCode.FORBIDDEN):
        return AuthRejected(
            f"{op} refused: {exc.code}: {exc.message} (give the API token with --token, "
            "--token-file or KVSERVER_API_TOKEN)"
        )
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
    with Client(check_url(url), timeout=timeout, token=cli_token()) as client:
        t0 = time.perf_counter()
        result = zmq_call(client, op, timeout, **fields)
        return result, time.perf_counter() - t0


_HTTP_CLIENTS: dict[str, Any] = {}


def http_client(url: str) -> Any:
    """One httpx.Client per base url, reused: a round trip then measures the request, not the ~200 ms
    of building a client (TLS context, pools) that a fresh one costs."""
    import httpx

    base = url.rstrip("/")
    client = _HTTP_CLIENTS.get(base)
    if client is None:
        client = _HTTP_CLIENTS[base] = httpx.Client(trust_env=False)
    return client


def close_http_clients() -> None:
    while _HTTP_CLIENTS:
        _HTTP_CLIENTS.popitem()[1].close()


def http_request(method: str, url: str, path: str, timeout: float, json_body: Any = None) -> tuple[int, Any, float]:
    """One request to url+path: (status, parsed JSON or text, seconds); Unreachable when no answer came."""
    import httpx

    full = url.rstrip("/") + path
    client = http_client(url)
    headers = auth_headers(url)
    t0 = time.perf_counter()
    try:
        resp = client.request(method, full, timeout=timeout, headers=headers, json=json_body)
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


def http_get(url: str, path: str, timeout: float) -> tuple[int, Any, float]:
    return http_request("GET", url, path, timeout)


def auth_headers(url: str) -> dict[str, str]:
    """Bearer token: --token/--token-file, else as every client finds it ($KVSERVER_API_TOKEN,
    $KVSERVER_API_TOKEN_FILE, or the server's default token file for a loopback URL)."""
    token = token_for(url)
    return {"Authorization": f"Bearer {token}"} if token else {}


def _detail(body: Any) -> str:
    if isinstance(body, dict):
        nested = body.get("error")
        err: dict[str, Any] = nested if isinstance(nested, dict) else body
        message = err.get("message") or err.get("detail")
        code = err.get("code")
        if message:
            return f": {code}: {message}" if code else f": {message}"
    return ""


def http_json(url: str, path: str, timeout: float, method: str = "GET", json_body: Any = None) -> Any:
    """The JSON answer of a request that must succeed (2xx); Unreachable (AuthRejected) with the reason."""
    status, body, _ = http_request(method, url, path, timeout, json_body)
    if status in (401, 403):
        raise AuthRejected(
            f"{method} {path} answered HTTP {status}{_detail(body)} (give the API token with "
            "--token, --token-file or KVSERVER_API_TOKEN)"
        )
    if not 200 <= status < 300:
        raise Unreachable(f"{method} {path} answered HTTP {status}{_detail(body)}")
    if not isinstance(body, (dict, list)):
        raise Unreachable(f"{method} {path} did not answer JSON")
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

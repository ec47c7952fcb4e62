"""`--l2` URLs -> adapters, and URL redaction (passwords never reach logs, describe or status).

fs:///path[?fsync=1&capacity_gb=G&direct=1]  a directory, optionally bounded (LRU by access); direct:
                                           aligned files, read with O_DIRECT when not cached
redis://[user:pass@]host:port/db[?ttl=S&timeout=S&prefix=P]   (rediss:// for TLS)
redis+cluster://host:port[?ttl=S&timeout=S&prefix=P]          Redis Cluster (any node as seed)
s3://bucket/prefix[?endpoint=URL&region=R&timeout=S]
"""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from .base import L2Adapter
from .extras import require

SCHEMES = ("fs", "redis", "rediss", "redis+cluster", "rediss+cluster", "s3")


def redact(url: str) -> str:
    """The URL without any password (user names and everything else kept)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable url>"
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    user = f"{parts.username}@" if parts.username else ""
    return urlunsplit(parts._replace(netloc=user + host))


def _options(query: str, allowed: tuple[str, ...], url: str) -> dict[str, str]:
    opts = dict(parse_qsl(query, keep_blank_values=True))
    unknown = sorted(set(opts) - set(allowed))
    if unknown:
        raise ValueError(f"l2 url {redact(url)}: unknown options {unknown} (allowed: {list(allowed)})")
    return opts


def _positive(opts: dict[str, str], name: str, url: str) -> float | None:
    if name not in opts:
        return None
    try:
        value = float(opts[name])
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"l2 url {redact(url)}: {name} must be a positive number")
    return value


def make_adapter(url: str) -> L2Adapter:
    """Build (not connect) the adapter for one `--l2` URL; raises ValueError with a clear message."""
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise ValueError(f"l2 url is not a URL: {exc}") from None
    scheme, safe = parts.scheme.lower(), redact(url)
    if scheme not in SCHEMES:
        raise ValueError(f"l2 url {safe}: scheme must be one of {list(SCHEMES)}")
    if scheme == "fs":
        from .fs import FsAdapter

        opts = _options(parts.query, ("fsync", "capacity_gb", "direct"), url)
        path = parts.netloc + parts.path
        if not path:
            raise ValueError(f"l2 url {safe}: needs a directory, e.g. fs:///var/cache/kv")
        gb = _positive(opts, "capacity_gb", url)
        return FsAdapter(
            path,
            fsync=opts.get("fsync", "0") in ("1", "true", "yes"),
            url=safe,
            capacity=int(gb * (1 << 30)) if gb else None,
            direct=opts.get("direct", "0") in ("1", "true", "yes"),
        )
    if scheme == "s3":
        require("boto3", f"l2 url {safe}")
        from .s3 import S3Adapter

        opts = _options(parts.query, ("endpoint", "region", "timeout"), url)
        if not parts.netloc:
            raise ValueError(f"l2 url {safe}: needs a bucket, e.g. s3://bucket/prefix")
        return S3Adapter(
            parts.netloc,
            parts.path,
            url=safe,
            endpoint=opts.get("endpoint") or None,
            region=opts.get("region") or None,
            timeout=_positive(opts, "timeout", url) or 5.0,
        )
    require("redis", f"l2 url {safe}")
    from .redis_store import RedisAdapter

    opts = _options(parts.query, ("ttl", "timeout", "prefix"), url)
    if not parts.hostname:
        raise ValueError(f"l2 url {safe}: needs a host, e.g. redis://127.0.0.1:6379/0")
    cluster = scheme.endswith("+cluster")
    if cluster and parts.path.strip("/") not in ("", "0"):
        raise ValueError(f"l2 url {safe}: Redis Cluster has only database 0")
    if not cluster and parts.path.strip("/") and not parts.path.strip("/").isdigit():
        raise ValueError(f"l2 url {safe}: the path must be a database number")
    ttl = _positive(opts, "ttl", url)
    rest = {k: v for k, v in parse_qsl(parts.query) if k not in ("ttl", "timeout", "prefix")}
    client_url = urlunsplit(
        parts._replace(scheme=scheme.split("+")[0], query=urlencode(rest), path="" if cluster else parts.path)
    )
    return RedisAdapter(
        client_url,
        url=safe,
        cluster=cluster,
        ttl=int(ttl) if ttl else None,
        timeout=_positive(opts, "timeout", url) or 2.0,
        prefix=opts.get("prefix", ""),
    )

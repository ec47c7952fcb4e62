"""Server configuration: one typed dataclass, filled from flags, KVSERVER_* env vars or a TOML file.

Precedence: command-line flag > environment variable > config file > default.
"""

from __future__ import annotations

import math
import tomllib
import types
import typing
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from kvprotocol import DEFAULT_CHUNK_SIZE, DEFAULT_HTTP_PORT, DEFAULT_PORT, exposure_refusal, is_loopback

from .l1.eviction import POLICIES

SECRET_FIELDS = ("api_token",)
# commit-time admission (l2/admission.py), or write on L1 eviction (l2/demotion.py): every victim, or hit ones
ADMISSIONS = ("all", "second-hit", "tinylfu", "evicted", "evicted-hit")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    l1_size_gb: float = 4.0
    ec_size_gb: float = 1.0  # the encoder cache's own budget (a second shm segment; see ec.py)
    prefault: bool = False  # allocate the arenas' pages at start (in the background), not at first write
    cold: bool = False  # discard the L1 arena a previous server left instead of adopting it (warm.py)
    chunk_size: int = DEFAULT_CHUNK_SIZE
    eviction_policy: str = "lhd"
    lease_ttl: float = 30.0
    reservation_lifetime: float = 300.0  # seconds a whole-request reservation may live, progress or not
    engine_ttl: float = 600.0  # seconds of keyspace silence before a registration nobody can check expires
    log_level: str = "info"
    shm_prefix: str = "kvserver"
    # HTTP admin API (0 disables it)
    http_host: str = "127.0.0.1"
    http_port: int = DEFAULT_HTTP_PORT
    api_token: str | None = None  # None: a token is generated into the default 0600 file (see auth.py)
    insecure: bool = False
    idle_timeout: float = 10.0  # seconds a connection may go without a request head (HTTP) or handshake (ZMQ)
    http_max_connections: int = 1024  # HTTP connections held; past it the longest-idle one is closed
    tenants_file: str | None = None  # None: $KVSERVER_STATE_DIR/tenants-<port>.json (kvserver tenant add)
    curve: bool | None = None  # ZMQ CURVE encryption; None: on exactly when --host is not loopback
    # L2 tiers, in order: fs:///path, redis://host:port/db, redis+cluster://..., s3://bucket/prefix
    l2: tuple[str, ...] = ()
    l2_compression: str = "none"
    l2_encryption_key_file: str | None = None
    l2_queue_size: int = 1024
    l2_prefetch_timeout: float = 0.5
    l2_admission: str = "all"  # "second-hit"/"tinylfu": keep one-hit wonders out of L2 (l2/admission.py)
    l2_negative_ttl: float = 1.0  # seconds a tier's "absent" answer is remembered (0: never)
    l2_verify: str = "reader"  # who checks a landed plain body: the reader's kvsum64, or the server too (serde.py)
    l2_retry_keys: int = 4096  # per tier: writes missed while it was down, retried when it answers
    l2_capacity_gb: float | None = None  # "evicted" admission: L2 bound kept by this server (l2/directory.py)
    l2_eviction_policy: str = "lru"  # "evicted" admission: which L1 policy class evicts from L2
    # fleet coordinator
    coordinator: str | None = None
    heartbeat_interval: float = 5.0
    # KV events for KV-aware routers (docs/kv-events.md); off unless an endpoint is set
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_buffer: int = 10_000
    kv_events_replay_max_bytes: int = 4 << 20  # per replay answer; the client asks again for the rest
    kv_events_replay_rate: int = 16 << 20  # bytes a second, all replay answers together
    kv_events_topic: str = "kv@{host}@{model}"
    kv_events_hash_format: str = "bytes"

    def __post_init__(self) -> None:
        if not 0 < self.l1_size_gb <= 4096:
            raise ValueError("l1_size_gb must be in (0, 4096]")
        if not 0 < self.ec_size_gb <= 4096:
            raise ValueError("ec_size_gb must be in (0, 4096]")
        if not 1 <= self.chunk_size <= 65536:
            raise ValueError("chunk_size must be in [1, 65536]")
        if self.eviction_policy not in POLICIES:
            raise ValueError(f"eviction_policy must be one of {sorted(POLICIES)}")
        if not 0 < self.lease_ttl <= 3600:
            raise ValueError("lease_ttl must be in (0, 3600] seconds")
        if not 0 < self.reservation_lifetime <= 86400:
            raise ValueError("reservation_lifetime must be in (0, 86400] seconds")
        if not 1 <= self.engine_ttl <= 86400:
            raise ValueError("engine_ttl must be in [1, 86400] seconds")
        if not 0.1 <= self.idle_timeout <= 3600:
            raise ValueError("idle_timeout must be in [0.1, 3600] seconds")
        if not 8 <= self.http_max_connections <= 1 << 20:
            raise ValueError("http_max_connections must be in [8, 2**20]")
        for name in ("port", "http_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} out of range")
        if self.api_token is not None and (not self.api_token or any(ch.isspace() for ch in self.api_token)):
            raise ValueError("api_token must be non-empty and contain no whitespace")
        if self.coordinator is not None and not self.coordinator.startswith(("http://", "https://")):
            raise ValueError("coordinator must be an http:// or https:// URL")
        if self.l2_admission not in ADMISSIONS:
            raise ValueError(f"l2_admission must be one of {list(ADMISSIONS)}")
        if self.l2_capacity_gb is not None and not self.l2_capacity_gb > 0:
            raise ValueError("l2_capacity_gb must be positive")
        if self.l2_capacity_gb is not None and not self.l2_admission.startswith("evicted"):
            raise ValueError("l2_capacity_gb needs l2_admission 'evicted' or 'evicted-hit' (or bound the store)")
        if self.l2_eviction_policy not in POLICIES:
            raise ValueError(f"l2_eviction_policy must be one of {sorted(POLICIES)}")
        if not 0 <= self.l2_negative_ttl <= 3600:
            raise ValueError("l2_negative_ttl must be in [0, 3600] seconds")
        if self.l2_verify not in ("reader", "server"):
            raise ValueError("l2_verify must be 'reader' or 'server'")
        if not 0 <= self.l2_retry_keys <= 1 << 24:
            raise ValueError("l2_retry_keys must be in [0, 16777216]")
        if not 0 < self.heartbeat_interval <= 3600:
            raise ValueError("heartbeat_interval must be in (0, 3600] seconds")
        kv_events_problem = _kv_events_problem(self)
        if kv_events_problem:
            raise ValueError(kv_events_problem)
        if self.curve is False and not is_loopback(self.host) and not self.insecure:
            raise ValueError(
                f"refusing to serve ZMQ on non-loopback address {self.host} without CURVE "
                "encryption (--no-curve): drop --no-curve, or pass --insecure"
            )
        problem = exposure_problem(self)
        if problem:
            raise ValueError(problem)

    @property
    def l1_bytes(self) -> int:
        return int(self.l1_size_gb * (1 << 30)) // 4096 * 4096

    @property
    def ec_bytes(self) -> int:
        return max(4096, int(self.ec_size_gb * (1 << 30)) // 4096 * 4096)

    @property
    def zmq_url(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    def public(self) -> dict[str, Any]:
        """What describe and the status endpoint show: never secrets."""
        data = asdict(self)
        for name in SECRET_FIELDS:
            data[name] = "<set>" if data[name] else None
        data["l2"] = [redact_url(url) for url in self.l2]
        data["coordinator"] = redact_url(self.coordinator) if self.coordinator else None
        return data


def redact_url(url: str) -> str:
    """Drop the user:password part of a URL (redis://:pw@host) so status output never leaks it."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    netloc, slash, path = rest.partition("/")
    if "@" in netloc:
        netloc = "<redacted>@" + netloc.rsplit("@", 1)[1]
    return f"{scheme}://{netloc}{slash}{path}"


def exposure_problem(config: ServerConfig) -> str | None:
    """Why this config would expose an unauthenticated endpoint beyond this host, or None.

    Admin endpoints that can clear or pin the cache must not be reachable from the network without
    a token; `--insecure` is the explicit, logged way to accept that.
    """
    if config.api_token or config.insecure:
        return None
    exposed = [
        (flag, host)
        for flag, host, on in (("--host", config.host, True), ("--http-host", config.http_host, config.http_port != 0))
        if on and not is_loopback(host)
    ]
    for flag, endpoint in (
        ("--kv-events-endpoint", config.kv_events_endpoint),
        ("--kv-events-replay-endpoint", config.kv_events_replay_endpoint),
    ):
        host = endpoint_host(endpoint) if endpoint else None
        if host is not None and not is_loopback(host):
            exposed.append((flag, host))
    if not exposed:
        return None
    flag, host = exposed[0]
    return exposure_refusal(host, flag, "KVSERVER_API_TOKEN")


def endpoint_host(endpoint: str) -> str | None:
    """The host of a tcp:// endpoint (brackets stripped); None for ipc:// (a socket file)."""
    scheme, _, rest = endpoint.partition("://")
    if scheme == "ipc":
        return None
    host = rest.rpartition(":")[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _kv_events_problem(config: ServerConfig) -> str | None:
    for flag, endpoint in (
        ("--kv-events-endpoint", config.kv_events_endpoint),
        ("--kv-events-replay-endpoint", config.kv_events_replay_endpoint),
    ):
        if endpoint is None:
            continue
        scheme, _, rest = endpoint.partition("://")
        if scheme == "ipc" and rest:
            continue
        port = rest.rpartition(":")[2]
        if scheme != "tcp" or not endpoint_host(endpoint) or not port.isdigit() or not 0 < int(port) <= 65535:
            return f"{flag} must be tcp://HOST:PORT or ipc://PATH (the server binds it), not {endpoint!r}"
    if config.kv_events_replay_endpoint and not config.kv_events_endpoint:
        return "--kv-events-replay-endpoint needs --kv-events-endpoint"
    if config.kv_events_endpoint and config.kv_events_endpoint == config.kv_events_replay_endpoint:
        return "--kv-events-endpoint and --kv-events-replay-endpoint must differ"
    if not 1 <= config.kv_events_buffer <= 1_000_000:
        return "kv_events_buffer must be in [1, 1000000] batches"
    if not 1 << 16 <= config.kv_events_replay_max_bytes <= 1 << 30:
        return "kv_events_replay_max_bytes must be in [65536, 1073741824]"
    if not 1 << 16 <= config.kv_events_replay_rate <= 1 << 34:
        return "kv_events_replay_rate must be in [65536, 17179869184] bytes a second"
    if config.kv_events_hash_format not in ("bytes", "int"):
        return "kv_events_hash_format must be 'bytes' or 'int'"
    try:
        config.kv_events_topic.format(host="h", model="m")
    except (KeyError, IndexError, ValueError) as exc:
        return f"kv_events_topic may only use {{host}} and {{model}}: {exc}"
    return None


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML file whose keys are option names (dashes or underscores), optionally under [kvserver]."""
    with open(path, "rb") as fh:
        raw = tomllib.load(fh)
    section = raw.get("kvserver", raw)
    known = {f.name for f in fields(ServerConfig)}
    out = {key.replace("-", "_"): value for key, value in section.items()}
    unknown = set(out) - known
    if unknown:
        raise ValueError(f"unknown config keys in {path}: {sorted(unknown)}")
    hints = typing.get_type_hints(ServerConfig)
    for key, value in out.items():
        if not _type_ok(value, hints[key]):
            raise ValueError(f"config key {key!r} in {path}: {value!r} is not {_type_name(hints[key])}")
    return out


def _type_ok(value: Any, hint: Any) -> bool:
    """Whether a TOML value has a field's type: exactly (true is not 1, 5555.5 is not a port)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_type_ok(value, arm) for arm in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    origin = typing.get_origin(hint)
    if origin in (list, tuple):
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        return isinstance(value, list) and all(_type_ok(v, args[0]) for v in value) if args else isinstance(value, list)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True  # a type this check does not model: the field's own validation decides


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(hint) if a is not type(None))
    names = {bool: "a boolean", int: "an integer", float: "a finite number", str: "a string"}
    return names.get(hint, f"a {getattr(hint, '__name__', hint)}")

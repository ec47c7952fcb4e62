"""Server configuration: one typed dataclass, filled from flags, KVSERVER_* env vars or a TOML file.

Precedence: command-line flag > environment variable > config file > default.
"""

from __future__ import annotations

import ipaddress
import tomllib
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from .eviction import POLICIES

SECRET_FIELDS = ("api_token",)


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 5555
    l1_size_gb: float = 4.0
    chunk_size: int = 256
    eviction_policy: str = "lru"
    lease_ttl: float = 30.0
    log_level: str = "info"
    shm_prefix: str = "kvserver"
    # HTTP admin API (0 disables it)
    http_host: str = "127.0.0.1"
    http_port: int = 8080
    api_token: str | None = None
    insecure: bool = False
    # L2 tiers, in order: fs:///path, redis://host:port/db, redis+cluster://..., s3://bucket/prefix
    l2: tuple[str, ...] = ()
    l2_compression: str = "none"
    l2_encryption_key_file: str | None = None
    l2_queue_size: int = 1024
    l2_prefetch_timeout: float = 0.5
    # fleet coordinator
    coordinator: str | None = None
    heartbeat_interval: float = 5.0

    def __post_init__(self) -> None:
        if not 0 < self.l1_size_gb <= 4096:
            raise ValueError("l1_size_gb must be in (0, 4096]")
        if not 1 <= self.chunk_size <= 65536:
            raise ValueError("chunk_size must be in [1, 65536]")
        if self.eviction_policy not in POLICIES:
            raise ValueError(f"eviction_policy must be one of {sorted(POLICIES)}")
        if not 0 < self.lease_ttl <= 3600:
            raise ValueError("lease_ttl must be in (0, 3600] seconds")
        for name in ("port", "http_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} out of range")

    @property
    def l1_bytes(self) -> int:
        return int(self.l1_size_gb * (1 << 30)) // 4096 * 4096

    @property
    def zmq_url(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    def public(self) -> dict[str, Any]:
        """What describe and the status endpoint show: never secrets."""
        data = asdict(self)
        for name in SECRET_FIELDS:
            data[name] = "<set>" if data[name] else None
        data["l2"] = list(self.l2)
        return data


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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
    return out

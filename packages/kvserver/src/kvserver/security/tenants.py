"""Tenants: who a credential is, and what that identity may name, hold and do.

A tenant is an operator-chosen name with its own API token (`kvserver tenant add NAME`), kept in a
0600 JSON file in the state directory (only a SHA-256 of each token is stored). The server derives
everything from the credential, never from a field the client fills in:

* keys: a tenant's cache salt is folded into `~NAME~salt` server-side, so no request of one tenant
  can name an object of another (the default tenant keeps plain salts; `~` is not allowed in a
  client's salt, so nobody can spell another tenant's prefix);
* handles: session ids live in the tenant's own namespace and stores record their owner, so an id
  of another tenant, guessed or replayed, is simply unknown (UNKNOWN_SESSION / UNKNOWN_STORE);
* bounds: an L1 byte quota (stores evict the tenant's own objects first, then get `no_space`), and
  caps on live sessions and store reservations (TOO_MANY), on the chunk hashes and leased keys its
  sessions hold (its share of the server's session-object budget), and on the L1 bytes its
  whole-request reservations book (a share of L1: one producer cannot book the arena for itself);
* the encoder cache likewise (ec.py, ec_tenants.py): items are keyed under the tenant, lease and
  store ids are random and owned, and each tenant has an EC byte quota and caps on EC leases and
  EC stores (defaults: a share of the server's EC segment and caps, so no single tenant takes it all);
* the data plane: shm mode hands out offsets into the one arena every shm client maps whole, so a
  tenant gets it only when added with `--allow-shm` (shm.py); the others move bytes over tcp.

The server's own token is the `default` tenant with admin rights (clear, describe of everything).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import re
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvprotocol._credentials import private_dir, state_dir, write_private

log = logging.getLogger("kvserver")

DEFAULT = "default"
TENANT_RE = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
MAX_TENANTS = 64  # tenant names become metric labels: a bounded set
DEFAULT_MAX_SESSIONS = 1024
DEFAULT_MAX_STORES = 1024
DEFAULT_MAX_SESSION_OBJECTS = 1 << 20  # a quarter of the server's session-object budget (service/session_admission.py)
RESERVATION_SHARE = 4  # without its own cap a tenant's reservations may book 1/4 of L1 (or its quota)
DEFAULT_EC_MAX_STORES = 256  # a quarter of the server's 1024 EC stores in flight
DEFAULT_EC_MAX_LEASES = 1 << 14  # a quarter of the server's 65536 live EC leases
EC_QUOTA_SHARE = 2  # without its own EC quota a tenant may hold 1/2 of the EC segment
RELOAD_INTERVAL = 1.0  # seconds between checks of the tenants file for changes


def tenants_path(port: int) -> Path:
    return state_dir() / f"tenants-{port}.json"


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class Tenant:
    name: str
    token_sha256: str = ""
    l1_quota_bytes: int | None = None  # None: no quota (the arena is the bound)
    max_sessions: int = DEFAULT_MAX_SESSIONS
    max_stores: int = DEFAULT_MAX_STORES
    ec_quota_bytes: int | None = None  # None: 1/EC_QUOTA_SHARE of the server's EC segment
    ec_max_stores: int = DEFAULT_EC_MAX_STORES
    ec_max_leases: int = DEFAULT_EC_MAX_LEASES
    max_session_objects: int = DEFAULT_MAX_SESSION_OBJECTS  # chunk hashes + leased keys of its sessions
    max_reserved_bytes: int | None = None  # None: 1/RESERVATION_SHARE of L1 (never more than its quota)
    allow_shm: bool = False  # shm mode maps the whole arena: only for tenants trusted with all of it

    def __post_init__(self) -> None:
        if not TENANT_RE.match(self.name):
            raise ValueError(f"tenant name {self.name!r}: 1-32 chars of [a-z0-9_-], starting with a letter")
        if self.l1_quota_bytes is not None and self.l1_quota_bytes < 0:
            raise ValueError("l1_quota_bytes must be >= 0")
        if not (1 <= self.max_sessions <= 1 << 20 and 1 <= self.max_stores <= 1 << 20):
            raise ValueError("max_sessions and max_stores must be in [1, 2**20]")
        if self.ec_quota_bytes is not None and self.ec_quota_bytes < 0:
            raise ValueError("ec_quota_bytes must be >= 0")
        if not (1 <= self.ec_max_stores <= 1 << 20 and 1 <= self.ec_max_leases <= 1 << 20):
            raise ValueError("ec_max_stores and ec_max_leases must be in [1, 2**20]")
        if not 1 <= self.max_session_objects <= 1 << 22:
            raise ValueError("max_session_objects must be in [1, 2**22]")
        if self.max_reserved_bytes is not None and self.max_reserved_bytes < 0:
            raise ValueError("max_reserved_bytes must be >= 0")


@dataclass(frozen=True)
class Identity:
    """Who sent a request: a tenant, and whether it holds the server's own (admin) token."""

    tenant: str
    admin: bool = False
    shm: bool = True  # may use shm mode (the server's own token; a tenant only with allow_shm)

    def salt(self, salt: str) -> str:
        """The key-space salt: the client's salt inside the tenant's namespace."""
        return salt if self.tenant == DEFAULT else f"~{self.tenant}~{salt}"

    def scope(self, handle: str) -> str:
        """A session id inside the tenant's namespace (NUL cannot be part of a tenant name)."""
        return f"{self.tenant}\x00{handle}"


ADMIN = Identity(DEFAULT, admin=True)


def tenant_of_salt(salt: str) -> str:
    """The tenant a key-space salt belongs to (see Identity.salt)."""
    if salt.startswith("~"):
        end = salt.find("~", 1)
        if end > 0:
            return salt[1:end]
    return DEFAULT


_INT_FIELDS = ("max_sessions", "max_stores", "ec_max_stores", "ec_max_leases", "max_session_objects")
_OPTIONAL_INT_FIELDS = ("l1_quota_bytes", "ec_quota_bytes", "max_reserved_bytes")


def check_trusted(path: Path) -> None:
    """Refuse a tenants file another user could have written: it names who may read whose KV.

    It must belong to this user (or root) and be writable by no one else; it may be readable (it
    holds only token digests).
    """
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) and st.st_uid not in (os.getuid(), 0):
        raise ValueError(f"{path} is a symlink of uid {st.st_uid}")
    st = os.stat(path)
    if st.st_uid not in (os.getuid(), 0):
        raise ValueError(f"{path} belongs to uid {st.st_uid}, not to this user: not trusted")
    if st.st_mode & 0o022:
        raise ValueError(
            f"{path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}): not trusted (chmod 600 it)"
        )


def _tenant(name: Any, entry: Any) -> Tenant:
    """One entry of the file, checked field by field (a null entry or a string quota is an error)."""
    if not isinstance(name, str) or not isinstance(entry, dict):
        raise ValueError(f"tenant {name!r}: an entry must be an object of limits")
    fields_ = {k: v for k, v in entry.items() if k != "name"}
    unknown = set(fields_) - {"token_sha256", "allow_shm", *_INT_FIELDS, *_OPTIONAL_INT_FIELDS}
    if unknown:
        raise ValueError(f"tenant {name!r}: unknown fields {sorted(unknown)}")
    if not isinstance(fields_.get("token_sha256", ""), str):
        raise ValueError(f"tenant {name!r}: token_sha256 must be a string")
    if not isinstance(fields_.get("allow_shm", False), bool):
        raise ValueError(f"tenant {name!r}: allow_shm must be true or false")
    for key in (*_INT_FIELDS, *_OPTIONAL_INT_FIELDS):
        value = fields_.get(key)
        if value is None and key in _OPTIONAL_INT_FIELDS:
            continue
        if key in fields_ and (not isinstance(value, int) or isinstance(value, bool)):
            raise ValueError(f"tenant {name!r}: {key} must be an integer")
    return Tenant(name=name, **fields_)


def load(path: Path) -> dict[str, Tenant]:
    if not path.exists():
        return {}
    check_trusted(path)
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("tenants", {}), dict):
        raise ValueError(f'{path}: expected {{"tenants": {{name: limits}}}}')
    return {name: _tenant(name, entry) for name, entry in data.get("tenants", {}).items()}


def save(path: Path, tenants: dict[str, Tenant]) -> None:
    private_dir(path.parent)
    body = {
        "version": 1,
        "tenants": {t.name: {k: v for k, v in asdict(t).items() if k != "name"} for t in tenants.values()},
    }
    write_private(path, json.dumps(body, indent=2) + "\n")


def add(
    path: Path,
    name: str,
    l1_quota_bytes: int | None = None,
    max_sessions: int = DEFAULT_MAX_SESSIONS,
    max_stores: int = DEFAULT_MAX_STORES,
    ec_quota_bytes: int | None = None,
    ec_max_stores: int = DEFAULT_EC_MAX_STORES,
    ec_max_leases: int = DEFAULT_EC_MAX_LEASES,
    max_session_objects: int = DEFAULT_MAX_SESSION_OBJECTS,
    max_reserved_bytes: int | None = None,
    allow_shm: bool = False,
) -> str:
    """Add (or re-key) a tenant; returns its new token, which is shown once and never stored."""
    if name == DEFAULT:
        raise ValueError("'default' is the server token's tenant; choose another name")
    tenants = load(path)
    if name not in tenants and len(tenants) >= MAX_TENANTS:
        raise ValueError(f"at most {MAX_TENANTS} tenants")
    token = "kvt-" + secrets.token_urlsafe(32)
    tenants[name] = Tenant(
        name,
        token_digest(token),
        l1_quota_bytes,
        max_sessions,
        max_stores,
        ec_quota_bytes,
        ec_max_stores,
        ec_max_leases,
        max_session_objects,
        max_reserved_bytes,
        allow_shm,
    )
    save(path, tenants)
    return token


def remove(path: Path, name: str) -> bool:
    tenants = load(path)
    if tenants.pop(name, None) is None:
        return False
    save(path, tenants)
    return True


@dataclass
class TenantBook:
    """The tenants a running server knows, re-read when its file changes (no restart needed)."""

    path: Path
    tenants: dict[str, Tenant] = field(default_factory=dict)
    _by_digest: dict[str, Tenant] = field(default_factory=dict)
    _mtime: float = -1.0
    _checked: float = 0.0
    _failed_mtime: float = -2.0

    def __post_init__(self) -> None:
        self.reload()

    def reload(self) -> None:
        try:
            mtime = self.path.stat().st_mtime if self.path.exists() else 0.0
        except OSError as exc:
            log.warning("cannot read tenants file %s: %s (keeping the tenants known before)", self.path, exc)
            return
        if mtime in (self._mtime, self._failed_mtime):
            return  # unchanged (a bad file is reported once, not on every check)
        try:
            tenants = load(self.path)
        except (OSError, ValueError, TypeError) as exc:
            self._failed_mtime = mtime
            log.warning("cannot use tenants file %s: %s (keeping the tenants known before)", self.path, exc)
            return
        self._mtime = mtime
        self._failed_mtime = -2.0
        self.tenants = dict(list(tenants.items())[:MAX_TENANTS])
        self._by_digest = {t.token_sha256: t for t in self.tenants.values()}

    def identify(self, token: str) -> Tenant | None:
        """The tenant of a token; the file is re-checked (one stat) at most once per RELOAD_INTERVAL, so
        an added tenant works and a removed one stops within about a second, without a restart."""
        now = time.monotonic()
        if now - self._checked >= RELOAD_INTERVAL:
            self._checked = now
            self.reload()
        return self._by_digest.get(token_digest(token))

    def get(self, name: str) -> Tenant:
        """A tenant's limits; the default tenant (the server token) has only the server-wide ones."""
        return self.tenants.get(name) or Tenant(
            name, max_sessions=1 << 20, max_stores=1 << 20, max_session_objects=1 << 22
        )

    def describe(self) -> dict[str, Any]:
        return {
            t.name: {
                "l1_quota_bytes": t.l1_quota_bytes,
                "max_sessions": t.max_sessions,
                "max_stores": t.max_stores,
                "ec_quota_bytes": t.ec_quota_bytes,
                "ec_max_stores": t.ec_max_stores,
                "ec_max_leases": t.ec_max_leases,
                "max_session_objects": t.max_session_objects,
                "max_reserved_bytes": t.max_reserved_bytes,
                "allow_shm": t.allow_shm,
            }
            for t in self.tenants.values()
        }

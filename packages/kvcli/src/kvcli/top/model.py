"""Turning successive status snapshots into what an operator watches: rates, fill levels, up/down.

Servers report cumulative counters; rates are differences between two snapshots of the same
instance divided by the server-side time between them (its uptime), so a slow poll does not
distort them. A counter that went backwards means the server restarted: no rate until the next poll.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

MONITORING_OPS = frozenset({"describe", "ping"})  # our own polling is not traffic


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One poll of one instance: its status map, or why it could not be had."""

    id: str
    url: str
    t: float  # local wall time of the poll
    status: dict[str, Any] | None = None
    reason: str | None = None
    auth: bool = False  # it answered, but refused our token: AUTH, not DOWN

    @property
    def up(self) -> bool:
        return self.status is not None


@dataclass(slots=True)
class InstanceView:
    """One row of the dashboard."""

    id: str
    url: str
    up: bool = False
    auth: bool = False  # refused our token (the state column says AUTH)
    reason: str | None = None
    version: str | None = None
    uptime_s: float | None = None
    hit_rate: float | None = None  # over the last interval
    hit_rate_total: float | None = None  # since the server started
    l1_used: int = 0
    l1_capacity: int = 0
    l1_objects: int = 0
    l2_objects: int = 0
    l2_bytes: int = 0
    ec_used: int = 0  # the encoder cache, apart from L1's KV (its own budget)
    ec_capacity: int = 0
    ec_objects: int = 0
    ec_hit_rate_total: float | None = None  # items found of items asked, since the server started
    ops_s: float | None = None
    evictions_s: float | None = None
    errors_s: float | None = None
    errors_total: int = 0
    bytes_s: float | None = None  # stored + retrieved bytes per second
    engines: int = 0
    sessions: int = 0
    no_space_s: float | None = None  # stores refused for space per second
    p99_s: float | None = None  # lookup latency p99 over the last interval (describe's "latency" buckets)
    tiers: list[dict[str, Any]] = field(default_factory=list)  # per L2 tier: tier, url, up, dropped, errors
    l2_queue: int | None = None  # write-behind queue depth (None without L2)
    l2_dropped: int = 0  # write-behind overflow since start
    models: list[str] = field(default_factory=list)
    tenants: list[str] = field(default_factory=list)  # tenants holding L1 bytes or sessions
    last_seen: float | None = None
    status: dict[str, Any] | None = None

    @property
    def l1_fraction(self) -> float | None:
        return self.l1_used / self.l1_capacity if self.l1_capacity else None

    @property
    def state(self) -> str:
        return "up" if self.up else ("AUTH" if self.auth else "DOWN")

    @property
    def tiers_down(self) -> list[str]:
        return [str(t.get("tier") or t.get("url")) for t in self.tiers if t.get("up") is False]

    def to_json(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__slots__ if k != "status"}
        out["l1_fraction"] = self.l1_fraction
        out["state"] = self.state
        return out


def _totals(status: dict[str, Any]) -> dict[str, float]:
    c, l1 = status.get("counters", {}), status.get("l1", {})
    return {
        "uptime": float(status.get("uptime_s", 0.0)),
        "ops": float(sum(v for k, v in status.get("ops", {}).items() if k not in MONITORING_OPS)),
        "errors": float(sum(status.get("errors", {}).values())),
        "evictions": float(l1.get("evictions", 0)),
        "lookup_tokens": float(c.get("lookup_tokens", 0)),
        "hit_tokens": float(c.get("lookup_hit_tokens", 0)),
        "bytes": float(c.get("stored_bytes", 0) + c.get("retrieved_bytes", 0)),
        "no_space": float(c.get("no_space", 0)),
    }


P99_OP = "lookup"  # the op an engine's scheduler waits on


def interval_p99(now: dict[str, Any] | None, prev: dict[str, Any] | None, op: str = P99_OP) -> float | None:
    """p99 latency (seconds, the bucket's upper bound) of `op` between two describe "latency" maps."""
    if not now or not prev or now.get("bounds_s") != prev.get("bounds_s"):
        return None
    bounds = now.get("bounds_s") or []
    cur = (now.get("ops") or {}).get(op) or []
    old = (prev.get("ops") or {}).get(op) or [0] * len(cur)
    if len(cur) != len(bounds) + 1 or len(old) != len(cur):
        return None
    delta = [a - b for a, b in zip(cur, old)]
    total = sum(delta)
    if total <= 0 or any(d < 0 for d in delta):
        return None
    seen = 0
    for i, n in enumerate(delta):
        seen += n
        if seen >= 0.99 * total:
            return float(bounds[i]) if i < len(bounds) else float("inf")
    return None


@dataclass
class Point:
    """One chart sample of the whole fleet."""

    t: float
    bytes_s: float
    hit_rate: float | None
    ops_s: float


@dataclass
class Fleet:
    """Everything the dashboard shows, updated one poll at a time."""

    history_len: int = 300
    views: dict[str, InstanceView] = field(default_factory=dict)
    history: deque[Point] = field(default_factory=deque)
    instance_history: dict[str, deque[Point]] = field(default_factory=dict)
    _prev: dict[str, dict[str, float]] = field(default_factory=dict)
    _prev_latency: dict[str, Any] = field(default_factory=dict)
    polls: int = 0

    def update(self, snapshots: list[Snapshot]) -> None:
        self.polls += 1
        now = max((s.t for s in snapshots), default=0.0)
        d_hit = d_lookup = fleet_bytes = fleet_ops = 0.0
        seen = set()
        for snap in snapshots:
            seen.add(snap.id)
            view = self.views.setdefault(snap.id, InstanceView(snap.id, snap.url))
            view.url = snap.url
            if not snap.up:
                view.up, view.auth, view.reason = False, snap.auth, snap.reason or "unreachable"
                view.ops_s = view.evictions_s = view.errors_s = view.bytes_s = view.hit_rate = None
                view.no_space_s = view.p99_s = None
                self._prev.pop(snap.id, None)
                self._prev_latency.pop(snap.id, None)
                self._sample(snap.id, Point(snap.t, 0.0, None, 0.0))
                continue
            assert snap.status is not None
            delta = self._fill(view, snap)
            if delta is not None:
                d_hit += delta["hit_tokens"]
                d_lookup += delta["lookup_tokens"]
                fleet_bytes += view.bytes_s or 0.0
                fleet_ops += view.ops_s or 0.0
            self._sample(snap.id, Point(snap.t, view.bytes_s or 0.0, view.hit_rate, view.ops_s or 0.0))
        for gone in set(self.views) - seen:  # the source no longer lists it (e.g. deregistered)
            self.views[gone].up, self.views[gone].auth, self.views[gone].reason = False, False, "no longer listed"
        self.history.append(Point(now, fleet_bytes, d_hit / d_lookup if d_lookup else None, fleet_ops))
        while len(self.history) > self.history_len:
            self.history.popleft()

    def _sample(self, iid: str, point: Point) -> None:
        hist = self.instance_history.setdefault(iid, deque(maxlen=self.history_len))
        hist.append(point)

    def _fill(self, view: InstanceView, snap: Snapshot) -> dict[str, float] | None:
        status = snap.status or {}
        l1, c = status.get("l1", {}), status.get("counters", {})
        tiers = status.get("l2") or []
        view.up, view.auth, view.reason, view.status, view.last_seen = True, False, None, status, snap.t
        view.version, view.uptime_s = status.get("version"), status.get("uptime_s")
        view.l1_used, view.l1_capacity = int(l1.get("used_bytes", 0)), int(l1.get("capacity_bytes", 0))
        view.l1_objects = int(l1.get("objects", 0))
        view.l2_objects = int(sum(t.get("objects", 0) or 0 for t in tiers))
        view.l2_bytes = int(sum(t.get("bytes", 0) or 0 for t in tiers))
        view.errors_total = int(sum(status.get("errors", {}).values()))
        ec = status.get("ec") or {}
        ec_c = ec.get("counters", {})
        view.ec_used, view.ec_capacity = int(ec.get("used_bytes", 0)), int(ec.get("capacity_bytes", 0))
        view.ec_objects = int(ec.get("objects", 0))
        asked = ec_c.get("hits", 0) + ec_c.get("misses", 0)
        view.ec_hit_rate_total = ec_c.get("hits", 0) / asked if asked else None
        view.engines, view.sessions = len(status.get("engines", [])), int(status.get("sessions", 0))
        _fill_l2_and_names(view, status)
        latency = status.get("latency") if isinstance(status.get("latency"), dict) else None
        view.p99_s = interval_p99(latency, self._prev_latency.get(view.id))
        if latency is not None:
            self._prev_latency[view.id] = latency
        lookups = c.get("lookup_tokens", 0)
        view.hit_rate_total = c.get("lookup_hit_tokens", 0) / lookups if lookups else None
        now, prev = _totals(status), self._prev.get(view.id)
        self._prev[view.id] = now
        if prev is None:
            return None
        delta = {k: now[k] - prev[k] for k in now}
        dt = delta["uptime"]
        if dt <= 0 or any(v < 0 for v in delta.values()):  # restarted, or the same snapshot twice
            view.ops_s = view.evictions_s = view.errors_s = view.bytes_s = view.hit_rate = None
            view.no_space_s = view.p99_s = None
            return None
        view.no_space_s = delta["no_space"] / dt
        view.ops_s = delta["ops"] / dt
        view.evictions_s = delta["evictions"] / dt
        view.errors_s = delta["errors"] / dt
        view.bytes_s = delta["bytes"] / dt
        view.hit_rate = delta["hit_tokens"] / delta["lookup_tokens"] if delta["lookup_tokens"] else None
        return delta

    def rows(self, sort: str = "id", text: str = "") -> list[InstanceView]:
        """Views sorted for display (down instances last under every key but id), those matching `text` only."""
        views = [v for v in self.views.values() if matches(v, text)]
        if sort == "id":
            return sorted(views, key=lambda v: v.id)
        key = {
            "hit": lambda v: v.hit_rate or 0.0,
            "ops": lambda v: v.ops_s or 0.0,
            "l1": lambda v: v.l1_fraction or 0.0,
            "errors": lambda v: float(v.errors_total),
        }[sort]
        return sorted(views, key=lambda v: (not v.up, -key(v), v.id))


SORT_KEYS = ("id", "hit", "ops", "l1", "errors")


def matches(view: InstanceView, text: str) -> bool:
    """The `/` filter: a case-insensitive substring of the id, url, state, a model or a tenant."""
    if not text:
        return True
    needle = text.lower()
    return any(needle in field.lower() for field in (view.id, view.url, view.state, *view.models, *view.tenants))


def _fill_l2_and_names(view: InstanceView, status: dict[str, Any]) -> None:
    tiers = status.get("l2") or []
    view.tiers = [
        {k: t.get(k) for k in ("tier", "url", "up", "dropped", "errors", "retry_pending")}
        for t in tiers
        if isinstance(t, dict)
    ]
    queue = status.get("l2_queue") if isinstance(status.get("l2_queue"), dict) else None
    view.l2_queue = int(queue.get("queued", 0)) if queue else None
    view.l2_dropped = int(queue.get("dropped", 0)) if queue else 0
    view.models = sorted({str(e.get("model")) for e in status.get("engines", []) if isinstance(e, dict)})
    raw = status.get("tenants")
    tenants: dict[str, Any] = raw if isinstance(raw, dict) else {}
    view.tenants = sorted(
        name for name, t in tenants.items() if isinstance(t, dict) and (t.get("l1_used_bytes") or t.get("sessions"))
    )

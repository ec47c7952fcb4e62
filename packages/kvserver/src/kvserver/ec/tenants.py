"""Per-tenant bounds of the encoder cache: byte quota, fair share under segment pressure, lease and store caps.

Why its own module: ec.py only asks "what may this tenant hold, lease, open?" and "whose objects may
this store evict?"; the rules live here.

* Quota: a hard cap on the EC bytes a tenant holds (reserved, ready, and aborted slots still in
  quarantine). A store past it evicts the tenant's own least recently used, unleased objects, then
  answers `no_space`. A tenant without its own `ec_quota_bytes` may hold 1/EC_QUOTA_SHARE of the
  segment; the server's own token (the `default` tenant) has no quota but the segment.
* Fair share: when the segment itself is full (quotas may add up to more than it holds), a store
  evicts only objects of tenants holding more than capacity / (tenants holding EC bytes), the most
  over first, then its own. A tenant within its fair share never loses an object to another.
* Caps: live leases and stores in flight per tenant (TOO_MANY, or a `null` hit for a lookup that
  cannot lease), below the server-wide ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..security.tenants import DEFAULT, EC_QUOTA_SHARE, Tenant, TenantBook


@dataclass
class ECTenantUsage:
    used_bytes: int = 0  # reserved + ready + quarantined: what the tenant keeps from others
    leases: int = 0
    stores: int = 0
    quota_evictions: int = 0  # own objects evicted to stay within the quota
    quota_refusals: int = 0  # stores refused at the quota (no_space)
    fair_share_evictions: int = 0  # own objects evicted for another tenant while over its fair share
    refused_leases: int = 0  # hits not leased (a null) or retrieves refused at the lease cap
    refused_stores: int = 0  # stores refused at the store cap (TOO_MANY)


class ECTenants:
    def __init__(self, capacity: int, book: TenantBook | None, server_caps: tuple[int, int]) -> None:
        self.capacity = capacity
        self.book = book
        self.server_caps = server_caps  # (stores, leases): all the default tenant is bound by
        self.usage: dict[str, ECTenantUsage] = {}

    def of(self, tenant: str) -> ECTenantUsage:
        u = self.usage.get(tenant)
        if u is None:
            u = self.usage[tenant] = ECTenantUsage()
        return u

    def limits(self, tenant: str) -> tuple[int | None, int, int]:
        """(EC quota bytes or None, max stores, max leases) of a tenant."""
        stores, leases = self.server_caps
        if tenant == DEFAULT:
            return None, stores, leases
        t = self.book.tenants.get(tenant) if self.book is not None else None
        t = t or Tenant(tenant)  # a tenant removed since: the defaults (its token no longer works)
        quota = t.ec_quota_bytes if t.ec_quota_bytes is not None else self.capacity // EC_QUOTA_SHARE
        return quota, min(t.ec_max_stores, stores), min(t.ec_max_leases, leases)

    def over_fair_share(self, tenant: str) -> list[str]:
        """Other tenants holding more than their fair share of the segment, the most over first."""
        holders = {t for t, u in self.usage.items() if u.used_bytes > 0} | {tenant}
        fair = self.capacity // len(holders)
        over = [(u.used_bytes - fair, t) for t, u in self.usage.items() if t != tenant and u.used_bytes > fair]
        return [t for _, t in sorted(over, reverse=True)]

    def describe(self, tenant: str) -> dict[str, Any]:
        """The `ec_*` fields of a tenant's usage row (describe `tenants.<name>`, /metrics)."""
        quota, max_stores, max_leases = self.limits(tenant)
        u = self.usage.get(tenant) or ECTenantUsage()
        return {
            "ec_used_bytes": u.used_bytes,
            "ec_quota_bytes": quota,
            "ec_leases": u.leases,
            "ec_stores_in_flight": u.stores,
            "ec_max_leases": max_leases,
            "ec_max_stores": max_stores,
            "ec_quota_evictions": u.quota_evictions,
            "ec_quota_refusals": u.quota_refusals,
            "ec_fair_share_evictions": u.fair_share_evictions,
            "ec_refused_leases": u.refused_leases,
            "ec_refused_stores": u.refused_stores,
        }

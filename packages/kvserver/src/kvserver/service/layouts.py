"""Registered layouts (fingerprint -> object bytes and geometry), bounded per tenant and in total.

Why its own module: every registration used to add its layouts for good, so one tenant could grow
the table without bound. Each tenant now claims the layouts it registers; past its cap (or the
server's), layouts that none of the claimant's live engines use are forgotten first, then the
registration is refused with TOO_MANY. The server's own token (the `default` tenant) has no
per-tenant cap, only the total.

Forgetting a layout never touches an object: objects stay in L1/L2 until evicted as usual and stay
charged to their tenant. Plain full-attention objects still hit; objects of a layout with a
geometry miss (planned as full attention); stores under it answer LAYOUT_MISMATCH. An engine that
registers the layout again restores exactly the old keys (size and geometry are a pure function of
the fingerprint), so nothing is ever read under another layout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvprotocol import LayoutDescriptor

from ..errors import TooMany
from .groups import GroupBook
from ..security.tenants import DEFAULT

MAX_TENANT_LAYOUTS = 256  # distinct layouts one tenant may hold registered (a model has a few)
MAX_LAYOUTS = 16384  # all tenants together: 64 tenants x 256, so only the server's own token reaches it

InUse = Callable[[str | None], set[str]]  # fingerprints live engines use (of one tenant; None: all)


class LayoutBook:
    def __init__(self, groups: GroupBook, per_tenant: int = MAX_TENANT_LAYOUTS, total: int = MAX_LAYOUTS) -> None:
        self.groups = groups
        self.per_tenant = per_tenant
        self.total = total
        self.sizes: dict[str, int] = {}  # fingerprint -> object bytes (the store paths read it)
        self.claims: dict[str, set[str]] = {}  # tenant -> fingerprints it registered
        self.forgotten = 0
        self.refused = 0

    def admit(self, tenant: str, layouts: list[LayoutDescriptor], in_use: InUse) -> None:
        """Record a registration's layouts for `tenant`, or raise TooMany and record none of them."""
        fps = {layout.fingerprint for layout in layouts}
        if tenant != DEFAULT and len(self.claims.get(tenant, set()) | fps) > self.per_tenant:
            self._release(tenant, self.claims[tenant] - fps - in_use(tenant))
            if len(self.claims.get(tenant, set()) | fps) > self.per_tenant:
                self.refused += 1
                raise TooMany(
                    f"tenant {tenant!r} has {self.per_tenant} layouts registered by live engines; "
                    "stop some engines (their layouts are then forgotten) and retry"
                )
        new = fps - self.sizes.keys()
        if new and len(self.sizes) + len(new) > self.total:
            live = in_use(None) | fps
            for name in list(self.claims):
                self._release(name, self.claims[name] - live)
            if len(self.sizes) + len(new) > self.total:
                self.refused += 1
                raise TooMany(f"{self.total} layouts are registered by live engines; stop some and retry")
        for layout in layouts:
            self.sizes[layout.fingerprint] = layout.object_bytes
            self.groups.add(layout)
        self.claims.setdefault(tenant, set()).update(fps)

    def _release(self, tenant: str, fps: Iterable[str]) -> None:
        """Drop `tenant`'s claims on fps; a layout nobody claims any more is forgotten."""
        mine = self.claims.get(tenant)
        if mine is None:
            return
        dropped = set(fps) & mine
        mine -= dropped
        if not mine:
            del self.claims[tenant]
        orphans = [fp for fp in dropped if not any(fp in c for c in self.claims.values())]
        for fp in orphans:
            del self.sizes[fp]
        self.groups.forget(orphans)
        self.forgotten += len(orphans)

    def describe(self) -> dict[str, int]:
        return {"registered": len(self.sizes), "forgotten": self.forgotten, "refused": self.refused}

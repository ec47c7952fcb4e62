"""Who may use shm mode: the server's own token, and tenants added with `--allow-shm`.

An shm client maps the whole arena: it can read and overwrite every tenant's objects, and an shm
store it never writes would commit whatever bytes a freed slot still holds (another tenant's). So
the server hands arena offsets and the arena's name only to identities trusted with all of it; the
others store and read over tcp, where the server copies every byte in and out itself.
"""

from __future__ import annotations

from typing import Any

from kvprotocol._replies import ArenaInfo

from ..errors import Forbidden
from .tenants import Identity

NO_ARENA = ArenaInfo(name="", size=0, nonce="")  # what a tenant without shm learns of an arena


def check_mode(op: str, req: Any, who: Identity) -> None:
    """Refuse an shm-mode request (store, retrieve, blend_store, ec_store, ec_retrieve) from a
    tenant without shm: FORBIDDEN, before anything is reserved or leased."""
    if not who.shm and getattr(req, "mode", None) == "shm":
        raise Forbidden(
            f"{op} in shm mode: tenant {who.tenant!r} may not map the arena (shm clients can read every "
            "tenant's objects); use mode 'tcp', or add the tenant with 'kvserver tenant add --allow-shm'"
        )


def arena_for(who: Identity, arena: ArenaInfo) -> ArenaInfo:
    """The arena a reply names: the real one for an identity with shm, else an empty name (use tcp)."""
    return arena if who.shm else NO_ARENA

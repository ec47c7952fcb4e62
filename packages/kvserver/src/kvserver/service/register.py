"""Engine registration: an engine rank's layouts checked and admitted, its row in the engine table.

Why apart from reads.py and writes.py: registration is what makes a layout's objects storable at all
(layouts.py learns their size and geometry); it touches no object.
May import: the service's own modules, `l1`, `security`, `errors`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvprotocol._replies import ArenaInfo, RegisterReply
from kvprotocol._requests import RegisterEngine

from ..errors import LayoutMismatch, NoSpace, OutOfRange
from .engines import Engine
from ..security.shm import arena_for
from ..security.tenants import ADMIN, Identity

if TYPE_CHECKING:
    from .state import CacheState


class Registration:
    """register_engine over the state's layouts and engine table."""

    def __init__(self, state: CacheState) -> None:
        self.l1, self.layouts, self.engine_table = state.l1, state.layouts, state.engine_table
        self.chunk_size = state.chunk_size

    def register_engine(self, f: RegisterEngine, engine_id: str, who: Identity = ADMIN) -> RegisterReply:
        layouts = f.layouts()
        for layout in layouts:
            if layout.chunk_size % self.chunk_size:
                raise LayoutMismatch(
                    f"layout chunk_size {layout.chunk_size} is not a "
                    f"multiple of the server chunk_size {self.chunk_size}"
                )
            if layout.object_bytes > self.l1.alloc.capacity:
                raise NoSpace("one object is larger than the whole L1 arena")
        if f.rank >= f.world_size:
            raise OutOfRange("rank must be < world_size")
        self.layouts.admit(who.tenant, layouts, self.engine_table.in_use)
        engine_id = self.engine_table.add(
            Engine(
                engine_id,
                f.model,
                f.world_size,
                f.rank,
                [g.to_wire() for g in layouts],
                f.host or "",
                f.pid or 0,
                tenant=who.tenant,
            ),
            [g.fingerprint for g in layouts],
        )
        arena = self.l1.arena
        return RegisterReply(
            engine_id=engine_id,
            arena=arena_for(who, ArenaInfo(name=arena.name, size=arena.size, nonce=arena.nonce)),
            chunk_size=self.chunk_size,
            groups=[g.fingerprint for g in layouts],
            tails=True,  # stores and lookups of a key space with a per-group geometry refuse or skip them
        )


__all__ = ["Registration"]

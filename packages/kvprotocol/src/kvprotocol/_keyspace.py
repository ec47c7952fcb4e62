"""KeySpace: the parts of an ObjectKey that one engine deployment shares for every chunk."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._layout import LayoutDescriptor

if TYPE_CHECKING:
    from ._requests import KeySpaceW


@dataclass(frozen=True, slots=True)
class KeySpace:
    """Model, world size and one layout fingerprint per object group."""

    model: str
    world_size: int
    groups: tuple[str, ...]

    @classmethod
    def from_layouts(cls, model: str, world_size: int, layouts: Sequence[LayoutDescriptor]) -> KeySpace:
        return cls(model, world_size, tuple(layout.fingerprint for layout in layouts))

    def to_wire(self) -> dict[str, Any]:
        return {"model": self.model, "world_size": self.world_size, "groups": list(self.groups)}

    def wire(self) -> KeySpaceW:
        """The typed wire form (kvprotocol._requests.KeySpaceW), as the typed requests carry it."""
        from ._requests import KeySpaceW

        return KeySpaceW(self.model, self.world_size, list(self.groups))

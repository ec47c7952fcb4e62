"""KeySpace: the parts of an ObjectKey that one engine deployment shares for every chunk."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, TypedDict

from ._layout import LayoutDescriptor

if TYPE_CHECKING:
    from ._requests import KeySpaceW


class KeySpaceWire(TypedDict):
    """A KeySpace as an untyped request (`Client.call`) carries it."""

    model: str
    world_size: int
    groups: list[str]


class KeySpace(NamedTuple):
    """Model, world size and one layout fingerprint per object group.

    A NamedTuple, like ObjectKey: the server keys per-keyspace memos by it, and it unpacks as
    `model, world_size, groups = ks`.
    """

    model: str
    world_size: int
    groups: tuple[str, ...]

    @classmethod
    def from_layouts(cls, model: str, world_size: int, layouts: Sequence[LayoutDescriptor]) -> KeySpace:
        return cls(model, world_size, tuple(layout.fingerprint for layout in layouts))

    def to_wire(self) -> KeySpaceWire:
        return {"model": self.model, "world_size": self.world_size, "groups": list(self.groups)}

    def wire(self) -> KeySpaceW:
        """The typed wire form (kvprotocol._requests.KeySpaceW), as the typed requests carry it."""
        from ._requests import KeySpaceW

        return KeySpaceW(self.model, self.world_size, list(self.groups))

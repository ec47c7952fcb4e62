"""Which L1 objects form one chunk, and which chunk extends which: what makes eviction prefix-aware.

A chunk is useful only if every (rank, group) object of it is present, and only if every chunk
before it is present too (a lookup stops at the first hole). So L1 evicts whole chunks ("families":
the objects sharing model, world size, salt and chunk hash), and only chunks no resident chunk
extends (leaves). A prefix therefore shrinks from its tail, and the chunks of a prefix that a store
is extending are never evicted by its own reservations (the new chunk is linked to its parent
before anything is evicted). Every policy gets this for free: it is part of `evictable`.
"""

from __future__ import annotations

from kvprotocol import ObjectKey

FamId = tuple[str, int, str, bytes]  # (model, world, salt, chunk hash)


def family_of(key: ObjectKey) -> FamId:
    return (key.model, key.world_size, key.salt, key.chunk_hash)


class PrefixIndex:
    def __init__(self) -> None:
        self.members: dict[FamId, list[ObjectKey]] = {}
        self.parent: dict[FamId, FamId] = {}
        self.children: dict[FamId, set[FamId]] = {}  # parent -> resident children (parent may be absent)

    def add(self, key: ObjectKey, parent_hash: bytes | None = None) -> None:
        fam = family_of(key)
        members = self.members.get(fam)
        if members is None:
            self.members[fam] = [key]
        else:
            members.append(key)
        if parent_hash is not None:
            self._link(fam, (key.model, key.world_size, key.salt, parent_hash))

    def link(self, child: FamId, parent: FamId) -> None:
        """Record that `child` extends `parent` (both resident or not); idempotent."""
        if child in self.members:
            self._link(child, parent)

    def _link(self, fam: FamId, parent: FamId) -> None:
        if fam not in self.parent and parent != fam:
            self.parent[fam] = parent
            self.children.setdefault(parent, set()).add(fam)

    def remove(self, key: ObjectKey) -> None:
        fam = family_of(key)
        members = self.members[fam]
        members.remove(key)
        if members:
            return
        del self.members[fam]
        parent = self.parent.pop(fam, None)
        if parent is not None:
            kids = self.children[parent]
            kids.discard(fam)
            if not kids:
                del self.children[parent]

    def siblings(self, key: ObjectKey) -> list[ObjectKey]:
        """Every resident object of key's chunk, key included."""
        return self.members[family_of(key)]

    def extended(self, key: ObjectKey) -> bool:
        """Whether some resident chunk extends key's chunk (so evicting it would cut a prefix)."""
        return family_of(key) in self.children

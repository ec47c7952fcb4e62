"""Loads in flight in this engine, by the prefix they bring in.

Why: requests that share a stored prefix tend to arrive together (one system prompt, an agent's
tool definitions, one document asked N questions). vLLM's prefix cache cannot share blocks that an
asynchronous load is still writing, so each of those requests would start a load of the same
chunks of its own, and the loader runs loads one after the other: the N-th request would wait for
N copies of the same bytes. vLLM caches a request's loaded blocks when its load ends, before it
schedules the requests that wait behind it. So a request whose next chunk another request is
loading asks vLLM to ask again later. When that load ends, it finds the prefix in vLLM's own cache
and loads only what is left, if anything. All N wait for one load, none for another's.

Only useful with vLLM's prefix caching on; the scheduler bounds each wait by the connector's timeout.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from hashlib import blake2b


def prefix_digests(
    tokens: Sequence[int], salt: str, extra: Sequence[tuple[int, bytes]], chunk: int, first: int, last: int
) -> list[bytes]:
    """For each chunk c in [first, last): a digest of everything that keys the prefix ending with
    chunk c (the salt, the tokens of chunks 0..c, the extra keys of those chunks)."""
    extras = dict(extra)
    h = blake2b(salt.encode(), digest_size=16)
    out = []
    for c in range(last):
        h.update(array("q", tokens[c * chunk : (c + 1) * chunk]).tobytes())
        part = extras.get(c)
        if part is not None:
            h.update(b"\x00extra")
            h.update(part)
        if c >= first:
            out.append(h.copy().digest())
    return out


class LocalLoads:
    """Which requests are loading the prefix ending with a chunk (by `prefix_digests`)."""

    def __init__(self) -> None:
        self._loaders: dict[bytes, list[str]] = {}
        self._digests: dict[str, list[bytes]] = {}

    def __len__(self) -> int:
        return len(self._digests)

    def add(self, req_id: str, digests: list[bytes]) -> None:
        """`req_id`'s load brings these prefixes in."""
        self._digests.setdefault(req_id, []).extend(digests)
        for d in digests:
            self._loaders.setdefault(d, []).append(req_id)

    def owner(self, digest: bytes) -> str | None:
        """The first request still loading that prefix, if any."""
        loaders = self._loaders.get(digest)
        return loaders[0] if loaders else None

    def done(self, req_id: str) -> None:
        """The load ended (loaded, failed or abandoned with its request)."""
        for d in self._digests.pop(req_id, ()):
            loaders = self._loaders[d]
            loaders.remove(req_id)
            if not loaders:
                del self._loaders[d]


__all__ = ["LocalLoads", "prefix_digests"]

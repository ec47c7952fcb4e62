"""What the policy unit tests share: evict everything a policy offers, in its order."""

from __future__ import annotations

from typing import Any

ALL = lambda _k: True  # noqa: E731


def drain(policy: Any, evictable: Any = ALL) -> list[Any]:
    out = []
    while (k := policy.pop_victim(evictable)) is not None:
        out.append(k)
    return out

"""Hit density with classes inherited along prefix chains (in the spirit of LHD, Beckmann et al.,
NSDI'18): evict the key with the fewest expected hits per unit of space-time.

Why: whether a cached prefix is read again depends on its history more than on its recency. On the
Mooncake conversation trace 31% of first turns get a second turn, 42% of second turns a third and
over 55% from the fourth on, and short first prompts return half as often as long ones; LRU cannot
tell a fifth turn from a one-off prompt. The density of a (class, age) is learned online from the
ages at which earlier keys of that class were read again (density.py).

With prefix-aware eviction the candidates are leaves, and a conversation's leaf is its newest chunk,
read at most once so far even at turn 8. So a key's class comes from its chain, which L1 reports
through `on_reserve` (the key a new key extends):
- level, how many times the chain was read: a new chain (no known parent, or a parent other chains
  also extend, such as a shared system prompt) starts at 1; a chain that extends the leaf a lookup
  just read inherits that leaf's level; each lookup adds one to the deepest key it read, and the
  keys above it take that level (lookups touch the tail first: the level is carried upwards); a key
  asked for again after its eviction comes back one level up.
- span, the length in chunks of the longest chain the key was part of (log2 buckets).
A key inserted without `on_reserve` is a level-1 root of span 1.

Evicted keys are remembered for a while (ghosts, GHOSTS per key the cache holds): their wait for a
reuse goes on, so the estimate learns reuse ages longer than today's cache lifetime.

Only leaves are ranked (ranking.py); a key whose children are all gone becomes a candidate again at
its own age and class. Every event is O(1) amortised: ranking is O(groups log groups) once per
coarse tick; a refresh, O(classes x ages), comes once per max(REFRESH, keys held) events; a change
of the age unit regroups every key and ghost, and comes a few times in a cache's life.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Generic

from .base import EvictionPolicy, Evictable, K
from .density import HitDensity
from .ranking import DensityRanking

LEVELS = 4  # level classes: read 1, 2, 3, 4 or more times
SPANS = 5  # span classes: 1-3, 4-7, 8-15, 16-31, 32+ chunks
CLASSES = LEVELS * SPANS
MAX_LEVEL = 64  # a shared head's level stops counting here
REFRESH = 1 << 12  # inserts + accesses between two refreshes of the estimate, at least
MAX_GROUPS = 4096  # more distinct (class, coarse time) groups than this: coarser time
GHOSTS = 4  # evicted keys remembered, per key the cache holds (at most)

Classify = Callable[[K, int, int], int]  # (key, level, span) -> class index


_SPAN_CLASS = [min(SPANS - 1, max(0, bits - 2)) for bits in range(65)]  # by the span's bit length


def default_class(level: int, span: int) -> int:
    """Class index of a chain read `level` times whose longest chain is `span` chunks."""
    return (min(level, LEVELS) - 1) * SPANS + _SPAN_CLASS[span.bit_length()]


class _Node(Generic[K]):
    """What the policy knows of one key (ready or still being written)."""

    __slots__ = ("children", "cls", "depth", "key", "last", "level", "parent", "ready", "span")

    def __init__(self, key: K, parent: _Node[K] | None, level: int, depth: int, now: int) -> None:
        self.key = key
        self.parent = parent
        self.children = 0  # keys (ready or being written) that extend this one
        self.ready = False
        self.level = level
        self.depth = depth
        self.span = depth
        self.last = now  # policy time of the last insert or access
        self.cls = 0


class LHDPolicy(EvictionPolicy[K]):
    name = "lhd"

    def __init__(self, estimator: HitDensity | None = None, classify: Classify[K] | None = None) -> None:
        """`estimator` and `classify` replace the online estimate and the lineage classes (the
        calibrated bounds of tracebounds.py); the estimator has as many classes as `classify` returns."""
        self.est = estimator if estimator is not None else HitDensity(CLASSES)
        self._classify = classify
        self._nodes: dict[K, _Node[K]] = {}
        self._leaves: DensityRanking[K] = DensityRanking(self.est)  # the ready leaves: the candidates
        self._ready = 0
        self._most = 0  # the most keys ever ready at once: bounds the ghosts, paces refreshes
        self._now = 0  # policy time: inserts + accesses so far
        self._next_refresh = REFRESH
        self._read_carry: dict[K, tuple[int, int]] = {}  # parent key -> (level, span) of the child just read
        self._write_carry: dict[K, int] = {}  # parent key -> span of the child just inserted
        self._ghosts: OrderedDict[K, tuple[int, int, int]] = OrderedDict()  # evicted key -> (class, last, level)
        self._waits: dict[tuple[int, int], int] = {}  # (class, coarse last access) -> keys + ghosts waiting

    # -- events ----------------------------------------------------------------------------------
    def on_reserve(self, key: K, parent: K | None) -> None:
        self._read_carry.clear()
        self._write_carry.clear()
        old = self._nodes.get(key)
        if old is not None:
            self._drop(old)
        p = None if parent is None else self._nodes.get(parent)
        if p is None:
            node = _Node(key, None, 1, 1, self._now)
        else:
            # a chain continued from its own leaf keeps its level; a branch off a shared head is new
            level = p.level if not p.ready or p.children == 0 else 1
            node = _Node(key, p, level, p.depth + 1, self._now)
            self._adopt(p)
        ghost = self._ghosts.pop(key, None)
        if ghost is not None:  # evicted, and asked for again: a reuse we could not serve
            cls, last, level = ghost
            self._end_wait(cls, last)
            self.est.reuse(cls, self._age(last))
            node.level = max(node.level, min(level + 1, MAX_LEVEL))
        self._nodes[key] = node

    def on_link(self, key: K, parent: K) -> None:
        node, p = self._nodes.get(key), self._nodes.get(parent)
        if node is not None and p is not None and node.parent is None and p is not node:
            node.parent = p
            self._adopt(p)

    def on_insert(self, key: K) -> None:
        self._read_carry.clear()
        node = self._nodes.get(key)
        if node is None or node.ready:
            if node is not None:
                self._drop(node)
            node = self._nodes[key] = _Node(key, None, 1, 1, self._now)
        node.ready = True
        self._ready += 1
        self._most = max(self._most, self._ready)
        node.span = max(node.span, self._write_carry.pop(key, 0))
        p = node.parent
        if p is not None and not p.ready:  # the same write: commits insert the tail first
            self._write_carry[p.key] = node.span
        self._start(node)

    def on_access(self, key: K) -> None:
        self.on_access_many((key,))

    def on_access_many(self, keys: Sequence[K]) -> None:
        """Each key's access in turn. One loop over locals, with `_start`, `default_class` and
        `HitDensity.reuse` inlined: a lookup touches every chunk it hit, so this is the policy's share
        of every lookup (16 keys: 20 us, against 31 us with those calls and 55 us for one call per key)."""
        nodes, carry, leaves, est, classify = self._nodes, self._read_carry, self._leaves, self.est, self._classify
        waits, shift = self._waits, est.shift  # replaced by a refresh or a regroup: read again after one
        reuses, octaves, last_bin = est.reuses, est.octaves, est.ages - 1
        span_class = _SPAN_CLASS
        for key in keys:
            node = nodes.get(key)
            if node is None or not node.ready:
                continue
            self._write_carry.clear()
            now, cls, last = self._now, node.cls, node.last
            wid = (cls, last >> shift)  # its wait ends: a reuse at its age
            left = waits[wid] - 1
            if left:
                waits[wid] = left
            else:
                del waits[wid]
            age = now - last  # est.reuse(cls, age):
            b = age >> shift
            reuses[cls][b if b < last_bin else last_bin] += 1.0
            b = age.bit_length()
            octaves[b if b < 63 else 63] += 1.0
            carried = carry.pop(key, None)
            if carried is None:  # the deepest key this lookup read
                level = node.level + 1
                node.level = level if level < MAX_LEVEL else MAX_LEVEL
            else:
                if carried[0] > node.level:
                    node.level = carried[0]
                if carried[1] > node.span:
                    node.span = carried[1]
            level, span = node.level, node.span
            if node.parent is not None:
                carry[node.parent.key] = (level, span)
            # _start: it waits for its next access from now
            node.last = now
            if classify is None:  # default_class(level, span)
                cls = ((level if level < LEVELS else LEVELS) - 1) * SPANS + span_class[span.bit_length()]
            else:
                cls = classify(key, level, span)
            node.cls = cls
            wid = (cls, now >> shift)
            waits[wid] = waits.get(wid, 0) + 1
            if node.children == 0:  # only leaves are candidates (_adopt takes a parent out)
                leaves.discard(key)
                leaves.add(key, cls, now)
            self._now = now = now + 1
            if now >= self._next_refresh:
                self._refresh()
                waits, shift = self._waits, est.shift
            elif leaves.groups > MAX_GROUPS and est.coarsen():
                self._regroup()
                waits, shift = self._waits, est.shift

    def on_remove(self, key: K) -> None:
        node = self._nodes.get(key)
        if node is not None:
            self._drop(node)

    def pop_victim(self, evictable: Evictable[K]) -> K | None:
        victim = self._leaves.victim(evictable, self._now)
        if victim is None:  # L1 may see leaves we do not (links it never told us of)
            victim = next((k for k, n in self._nodes.items() if n.ready and evictable(k)), None)
            if victim is None:
                return None
        node = self._nodes[victim]
        self._drop(node, waiting=True)
        self._ghosts[victim] = (node.cls, node.last, node.level)  # its wait for a reuse goes on
        if len(self._ghosts) > GHOSTS * self._most:
            _, (cls, last, _) = self._ghosts.popitem(last=False)
            self._end_wait(cls, last)
            self.est.censor(cls, self._age(last))
        return victim

    def __len__(self) -> int:
        return self._ready

    # -- internals -------------------------------------------------------------------------------
    def _start(self, node: _Node[K]) -> None:
        """A ready key begins to wait for its next access, now."""
        node.last = self._now
        node.cls = (
            default_class(node.level, node.span)
            if self._classify is None
            else self._classify(node.key, node.level, node.span)
        )
        self._start_wait(node.cls, node.last)
        if node.children == 0:
            self._leaves.add(node.key, node.cls, node.last)
        self._now += 1
        if self._now >= self._next_refresh:
            self._refresh()
        elif self._leaves.groups > MAX_GROUPS and self.est.coarsen():
            self._regroup()

    def _refresh(self) -> None:
        # paced by the keys held too, so that the per-refresh work stays O(1) per event
        self._next_refresh = self._now + max(REFRESH, self._most)
        if self.est.refresh(self.waiting()):
            self._regroup()
        self._leaves.invalidate()

    def _adopt(self, p: _Node[K]) -> None:
        p.children += 1
        self._leaves.discard(p.key)  # no longer a leaf

    def _drop(self, node: _Node[K], waiting: bool = False) -> None:
        """Forget a key (that, with `waiting`, waits on as a ghost); its parent becomes a candidate
        again when it was the last child."""
        del self._nodes[node.key]
        self._leaves.discard(node.key)
        if node.ready:
            self._ready -= 1
            node.ready = False
            if not waiting:
                self._end_wait(node.cls, node.last)
        p = node.parent
        if p is not None and self._nodes.get(p.key) is p:
            p.children -= 1
            if p.children == 0 and p.ready:
                self._leaves.add(p.key, p.cls, p.last)

    def _age(self, last: int) -> int:
        return self._now - last

    def _start_wait(self, cls: int, last: int) -> None:
        wid = (cls, last >> self.est.shift)
        self._waits[wid] = self._waits.get(wid, 0) + 1

    def _end_wait(self, cls: int, last: int) -> None:
        wid = (cls, last >> self.est.shift)
        left = self._waits[wid] - 1
        if left:
            self._waits[wid] = left
        else:
            del self._waits[wid]

    def waiting(self) -> list[list[float]]:
        """Per class, the ages of keys still waiting for their next access (ready and ghosts)."""
        est, tick = self.est, self._now >> self.est.shift
        out = [[0.0] * est.ages for _ in range(est.classes)]
        for (cls, start), n in self._waits.items():
            out[cls][est.bin(tick - start)] += n
        return out

    def _regroup(self) -> None:
        """Regroup the candidates and recount the waits after the coarse time unit changed."""
        nodes = self._nodes
        self._leaves.regroup(lambda k: (nodes[k].cls, nodes[k].last))
        self._waits = {}
        for node in nodes.values():
            if node.ready:
                self._start_wait(node.cls, node.last)
        for cls, last, _ in self._ghosts.values():
            self._start_wait(cls, last)

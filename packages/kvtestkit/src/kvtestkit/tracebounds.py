"""What an online policy could reach on a trace: the `lhd` policy with its statistics computed from
the whole trace in advance instead of learned as it goes ("oracle-calibrated").

Why: Belady's MIN knows every future request; a policy that ranks keys by class and age can at best
know each class's reuse statistics exactly. Replaying the trace once records every reuse and
censoring of the whole trace (no decay); the next replay ranks with densities computed from those,
fixed from the first request on. Each further pass uses the statistics of the pass before (the
classes of lineage depend a little on what stayed cached). Two kinds of classes:

- `lineage`: the policy's own (how often a chain was read, how long it is), as online;
- `trace`: what the trace reveals about each request, which no server sees: its turn in its
  conversation (1, 2, 3, 4+) and its input length (5 buckets), a block taking the class of the
  latest request that used it; blocks of several conversations (a shared system prompt) get a
  class of their own.
"""

from __future__ import annotations

from collections.abc import Callable

from kvprotocol import ObjectKey

from kvserver.l1.eviction.density import HitDensity
from kvserver.l1.eviction.lhd import CLASSES, LHDPolicy
from kvtestkit.tracesim import Request, block_of, simulate

TURNS = 4  # turn classes: 1, 2, 3, 4 or more
LENGTHS = (2000, 5000, 20000, 40000)  # input-token bucket bounds: 5 buckets
FEATURES = ("lineage", "trace")


def conversations(trace: list[Request]) -> tuple[list[int], list[int]]:
    """Each request's turn and conversation (the index of its first turn).

    A request continues the latest earlier request that shares its longest block prefix, when that
    prefix is at least 2 blocks long (one shared block is a common system prompt).
    """
    turn, root = [1] * len(trace), list(range(len(trace)))
    top: dict[int, list] = {}  # block -> [children, latest request through this node]
    for i, req in enumerate(trace):
        children, depth, owner = top, 0, -1
        for b in req.blocks:
            node = children.get(b)
            if node is None:
                break
            children, owner, depth = node[0], node[1], depth + 1
        if depth >= 2:
            turn[i], root[i] = turn[owner] + 1, root[owner]
        children = top
        for b in req.blocks:
            node = children.setdefault(b, [{}, i])
            node[1] = i
            children = node[0]
    return turn, root


def trace_classes(
    trace: list[Request],
) -> tuple[int, Callable[[ObjectKey, int, int], int], Callable[[int, Request], None]]:
    """(number of classes, classify, before each request) for classes from the trace's features."""
    turn, root = conversations(trace)
    seen: dict[int, int] = {}
    shared: set[int] = set()
    for i, req in enumerate(trace):
        for b in req.blocks:
            if seen.setdefault(b, root[i]) != root[i]:
                shared.add(b)
    own = TURNS * (len(LENGTHS) + 1)  # the class of blocks several conversations use
    current: dict[int, int] = {}

    def before(i: int, req: Request) -> None:
        if i == 0:
            current.clear()  # a new replay
        cls = (min(turn[i], TURNS) - 1) * (len(LENGTHS) + 1) + sum(req.input_tokens >= x for x in LENGTHS)
        for b in req.blocks:
            if b not in shared:
                current[b] = cls

    def classify(key: ObjectKey, level: int, span: int) -> int:
        return current.get(block_of(key), own)

    return own + 1, classify, before


def calibrated(trace: list[Request], capacity_blocks: int, features: str = "lineage", passes: int = 2) -> list[float]:
    """Token hit rates of `lhd` learning the whole trace's statistics (first), then of `passes`
    replays that use the statistics of the replay before, computed in advance."""
    if features == "lineage":
        classes, classify, before = CLASSES, None, None
    elif features == "trace":
        classes, classify, before = trace_classes(trace)
    else:
        raise ValueError(f"features must be one of {FEATURES}")
    est = HitDensity(classes, decay=1.0)
    rates = []
    for _ in range(passes + 1):
        policy: LHDPolicy[ObjectKey] = LHDPolicy(est, classify)
        rates.append(simulate(trace, policy, capacity_blocks, on_request=before))
        est = est.frozen_copy(policy.waiting())
    return rates

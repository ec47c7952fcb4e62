"""The hit-density policy (lhd) and its estimator: densities from reuse ages, lineage classes,
leaves-only candidates, ghosts, and what it learns from a stream that LRU cannot tell apart."""

from __future__ import annotations

import random

import pytest

from kvserver.l1.eviction import POLICIES, LRUPolicy, make_policy
from kvserver.l1.eviction import lhd
from kvserver.l1.eviction.density import HitDensity, density_curve, hazard
from kvserver.l1.eviction.lhd import LEVELS, REFRESH, SPANS, LHDPolicy, default_class

from policy_helpers import ALL, drain


def brute_density(h: list[float]) -> list[float]:
    """max over horizons b > a of hits gained / space-time spent, straight from the definition."""
    surv = [1.0]
    for x in h:
        surv.append(surv[-1] * (1 - x))
    out = []
    for a in range(len(h)):
        best = 0.0
        for b in range(a + 1, len(h) + 1):
            cost = sum(surv[a:b])
            if cost > 1e-12:
                best = max(best, (surv[a] - surv[b]) / cost)
        out.append(best)
    return out


# -- the estimator ---------------------------------------------------------------------------------
def test_a_constant_hazard_is_its_own_density():
    assert density_curve([0.1] * 8) == pytest.approx([0.1] * 8)


@pytest.mark.parametrize("seed", range(20))
def test_the_hull_walk_finds_the_best_horizon(seed):
    rng = random.Random(seed)
    h = [rng.choice([0.0, 0.0, rng.random() * 0.3, 1.0 if rng.random() < 0.05 else 0.02]) for _ in range(24)]
    assert density_curve(h) == pytest.approx(brute_density(h))


def test_density_looks_past_a_quiet_start():
    """Nothing comes back for three bins, then half at each: a young key is worth keeping."""
    d = density_curve([0.0, 0.0, 0.0, 0.5, 0.5, 0.5])
    assert 0 < d[0] < d[1] < d[2] < d[3] == pytest.approx(0.5)


def test_kaplan_meier_counts_the_censored_at_risk():
    # 4 keys reach age 2; 2 are read there, 2 are forgotten unread at age 3
    h = hazard([0, 0, 2, 0, 0], [0, 0, 0, 2, 0], [0.0] * 5, 0.0)
    assert h[:3] == [0.0, 0.0, 0.5]
    assert h[3] == 0.0
    assert h[4] == 0.0  # the last bin holds every older age: it claims nothing


def test_an_empty_class_borrows_the_density_of_all():
    est = HitDensity(3, ages=8)
    for _ in range(2000):  # many: a class's estimate is shrunk toward all classes' where it has few
        est.reuse(0, 1)  # class 0 comes back at once
        est.censor(1, 5)  # class 1 never does
    est.refresh()
    assert est.shift == 0
    d = est.density
    assert d[0][0] > 10 * d[1][0]
    assert min(d[0][0], d[1][0]) < d[2][0] < max(d[0][0], d[1][0])  # no data: somewhere between


def test_waiting_keys_keep_the_estimate_from_believing_everything_returns():
    est = HitDensity(1, ages=8)
    for _ in range(50):
        est.reuse(0, 2)
    alone = est.densities()[0][0]
    with_waiting = est.densities([[0, 0, 0, 0, 0, 0, 500, 0]])[0][0]
    assert with_waiting < alone / 5


def test_the_age_unit_follows_the_ages_seen():
    est = HitDensity(1, ages=16)
    for _ in range(100):
        est.reuse(0, 1000)  # ~ 1000 ticks: the last bin at shift 0
    assert est.refresh() == 6  # 15 << 6 = 960 < 1000 <= 15 << 7 ... the finest that fits
    assert est.shift == 6 and sum(est.reuses[0]) == pytest.approx(90)  # decayed, not lost
    est.octaves = [0.0] * 64
    for _ in range(100):
        est.reuse(0, 3)
    assert est.refresh() == -6


# -- the policy ------------------------------------------------------------------------------------
def chain(p, keys, parent=None):
    """A store of a chain, as L1 drives it: reserve head first (each extends the one before),
    commit tail first."""
    for k in keys:
        p.on_reserve(k, parent)
        parent = k
    for k in reversed(keys):
        p.on_insert(k)


def test_only_leaves_are_candidates():
    p, lru = make_policy("lhd"), LRUPolicy()
    for k in "abc":
        p.on_reserve(k, None if k == "a" else chr(ord(k) - 1))
    for k in "abc":  # head first this time: a is the oldest
        p.on_insert(k)
        lru.on_insert(k)
    assert drain(lru) == ["a", "b", "c"]
    assert drain(p) == ["c", "b", "a"]  # a prefix shrinks from its tail


def test_an_unfinished_child_gives_its_parent_back():
    p = make_policy("lhd")
    chain(p, ["a"])
    p.on_reserve("b", "a")  # b is being written: a is no leaf
    p.on_insert("x")
    assert p.pop_victim(ALL) == "x"  # the only leaf
    p.on_remove("b")  # the write was aborted
    assert p.pop_victim(ALL) == "a"


def test_a_link_learnt_later_hides_the_parent():
    p = make_policy("lhd")
    for k in ("a", "b", "c"):  # a prefetch reserves without parents
        p.on_reserve(k, None)
        p.on_insert(k)
    p.on_link("b", "a")
    p.on_link("c", "b")
    p.on_link("c", "b")  # idempotent
    assert drain(p) == ["c", "b", "a"]


def test_a_chain_read_again_climbs_a_level_and_passes_it_on():
    p = LHDPolicy()
    chain(p, ["sys"])
    chain(p, ["a1", "a2", "a3"], "sys")  # turn 1 of a conversation under a shared head
    chain(p, ["b1"], "sys")  # another conversation: sys is now a fork
    level = lambda k: p._nodes[k].level  # noqa: E731
    assert [level(k) for k in ("a1", "a2", "a3", "b1")] == [1, 1, 1, 1]
    for k in ("a3", "a2", "a1", "sys"):  # turn 2 reads turn 1, tail first
        p.on_access(k)
    assert [level(k) for k in ("a1", "a2", "a3")] == [2, 2, 2]
    chain(p, ["a4", "a5"], "a3")  # and extends it
    assert [level(k) for k in ("a4", "a5")] == [2, 2]
    assert p._nodes["a1"].span == 4 and p._nodes["a4"].span == 6  # sys, a1, a2, a3 (a4, a5)
    chain(p, ["c1"], "sys")  # a branch off the shared head starts over
    assert level("c1") == 1
    assert p._nodes["a5"].cls == default_class(2, 6) != p._nodes["c1"].cls


def test_a_key_asked_for_after_its_eviction_returns_a_level_up():
    p = LHDPolicy()
    chain(p, ["a"])
    assert p.pop_victim(ALL) == "a"
    chain(p, ["a"])
    assert p._nodes["a"].level == 2


def test_classes_cover_levels_and_spans():
    assert default_class(1, 1) == 0
    assert default_class(LEVELS + 5, 10_000) == LEVELS * SPANS - 1
    assert len({default_class(lv, sp) for lv in range(1, 9) for sp in (1, 3, 4, 8, 16, 32, 999)}) == LEVELS * SPANS


def conversation_stream(p, rounds: int, rng: random.Random) -> None:
    """One-off prompts (never read again) and conversations that come back, through the policy's
    interface the way L1 drives it, with 64 keys' room."""
    live: list[list[str]] = []
    resident: set[str] = set()
    n = 0

    def store(keys, parent=None):
        chain(p, keys, parent)
        resident.update(keys)
        while len(p) > 64:
            resident.discard(p.pop_victim(ALL))

    for r in range(rounds):
        if live and rng.random() < 0.3:  # a recent conversation returns: read whole, extended by one key
            conv = live.pop(rng.randrange(max(0, len(live) - 8), len(live)))
            if resident.issuperset(conv):
                for k in reversed(conv):
                    p.on_access(k)
                conv.append(f"c{r}")
                store(conv[-1:], conv[-2])
            else:
                conv = [f"c{r}"]
                store(conv)
            live.append(conv)
        else:  # a one-off prompt of two keys
            n += 1
            store([f"o{n}a", f"o{n}b"])
        if rng.random() < 0.2:  # a new conversation
            live.append([f"n{r}"])
            store(live[-1])


@pytest.mark.parametrize("policy", ["lhd", "lru"])
def test_learned_density_keeps_a_returning_conversation_over_newer_one_offs(policy):
    """The behaviour LRU lacks: after a stream where chains read again come back and one-off prompts
    never do, a chain read again outlives one-off prompts newer than its last use."""
    p = make_policy(policy)
    conversation_stream(p, 3 * REFRESH, random.Random(5))
    chain(p, ["x1", "x2"])  # a conversation's first turn...
    for k in ("x2", "x1"):
        p.on_access(k)  # ...read again
    gone = []
    for i in range(80):  # one-off prompts, all newer than x's last use; 64 keys' room
        chain(p, [f"late{i}"])
        while len(p) > 64:
            gone.append(p.pop_victim(ALL))
    first_late = next(i for i, k in enumerate(gone) if k.startswith("late"))
    if policy == "lru":
        assert "x2" in gone[:first_late]  # recency alone: it goes before any newer key
    else:
        assert "x2" not in gone[: first_late + 8], gone  # one-offs newer than it go first


def test_until_its_first_refresh_it_evicts_exactly_like_lru():
    """Before any statistics, every class ranks alike and older is worse: LRU, leaves only."""
    from kvprotocol import ObjectKey
    from kvserver.l1.arena import Arena
    from kvserver.l1.cache import L1Cache
    from kvserver.l1.slab import ALIGN

    def key(i: int) -> ObjectKey:
        return ObjectKey("m", "0" * 16, 1, 0, 0, "", i.to_bytes(32, "big"))

    orders = {}
    for name in ("lhd", "lru"):
        arena = Arena(f"kvserver-unit-test-lhd-{name}", 48 * ALIGN)
        try:
            l1 = L1Cache(arena, make_policy(name))
            evicted: list[ObjectKey] = []
            l1.on_evict.append(evicted.append)
            rng, convs, fresh = random.Random(11), [[0]], iter(range(1, 1 << 20))
            for _ in range(300):  # ~2,000 inserts and accesses: no refresh yet
                conv = rng.choice(convs) if rng.random() < 0.5 else [0]
                conv = conv + [next(fresh) for _ in range(rng.randint(1, 4))]
                convs.append(conv)
                keys = [key(b) for b in conv]
                hit = next((i for i, k in enumerate(keys) if l1.ready(k) is None), len(keys))
                for k in reversed(keys[:hit]):
                    l1.touch(k)
                written = []
                for i in range(hit, len(keys)):
                    if keys[i] not in l1.entries:
                        if l1.reserve(keys[i], ALIGN, conv[i - 1].to_bytes(32, "big") if i else None) is None:
                            break
                        written.append(keys[i])
                for k in reversed(written):
                    l1.finish_write(k)
            orders[name] = evicted
            if name == "lhd":
                assert l1.policy._now < REFRESH
        finally:
            arena.close()
    assert len(orders["lru"]) > 100
    assert orders["lhd"] == orders["lru"]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_lookups_accesses_in_one_call_are_the_single_accesses(name, monkeypatch):
    """A lookup touches its hits with one on_access_many (lhd's inlined loop); the order it leaves
    must be exactly that of one on_access per key, across lhd's refreshes and changes of age unit
    (made frequent here: a change mid-lookup replaces the wait counts the loop holds)."""
    monkeypatch.setattr(lhd, "MAX_GROUPS", 6)
    batched, single = make_policy(name), make_policy(name)
    rng = random.Random(7)
    convs: list[list[str]] = []
    victims: dict[str, list[str]] = {"batched": [], "single": []}
    for r in range(4 * REFRESH):
        if convs and rng.random() < 0.6:  # read a conversation, tail first, and extend it
            conv = rng.choice(convs[-40:])
            hit = conv[: rng.randint(1, len(conv))]
            batched.on_access_many(hit[::-1])
            for k in reversed(hit):
                single.on_access(k)
            new = [f"k{r}"]
            parent = hit[-1]
            conv[len(hit) :] = new
        else:
            new, parent = [f"k{r}a", f"k{r}b"], None
            convs.append(new[:])
        for p in (batched, single):
            chain(p, new, parent)
        for label, p in (("batched", batched), ("single", single)):
            while len(p) > 48:
                victims[label].append(p.pop_victim(ALL))
    assert len(victims["batched"]) > 2 * REFRESH
    assert victims["batched"] == victims["single"]
    assert drain(batched) == drain(single)
    if name == "lhd":
        assert batched.est.shift > 0 and batched.est.density == single.est.density  # it did refresh
        assert batched.waiting() == single.waiting()

"""Group kinds through the fs tier: a shared (MLA) object is written to L2 once, under its rank
sentinel, and a sliding-window snapshot under its boundary; after a restart (empty L1, a fresh
geometry learned again from the registration) both come back from L2 and hit exactly as before."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from kvtestkit.kvhelpers import lookup, register, retrieve, sid, store, tiny_layout
from l2util import data, prompt, wait_tier

L1 = ("--l1-size-gb", "0.02")


def test_shared_and_sliding_objects_survive_a_restart(server_factory, tmp_path: Path) -> None:
    root = tmp_path / "l2"
    args = (*L1, "--l2", f"fs://{root}")
    mla = [replace(tiny_layout(tag="mla"), shared=True)]
    sw = [tiny_layout(), replace(tiny_layout(), kind="sliding", window=64)]  # 2-block snapshots
    tokens_a, tokens_b = prompt(3, seed=1), prompt(3, seed=2)
    a = server_factory(*args)
    with a.client() as c:
        ks_m, _ = register(c, "m/mla", mla, world_size=2)
        store(c, ks_m, tokens_a, data(1), rank=0)
        assert store(c, ks_m, tokens_a, data(1), rank=1)["store_id"] is None  # rank 1 finds them present
        ks_s, _ = register(c, "m/sw", sw)
        sizes = {0: sw[0].object_bytes, 1: sw[1].object_bytes}
        store(c, ks_s, tokens_b, lambda ch, g: data(2)(ch, g)[: sizes[g]])
        wait_tier(c, "puts", 3 + 3 + 1)  # 3 shared objects (not 6), 3 chunks + 1 snapshot
    a.stop()
    assert len([p for p in (root / "objects").rglob("*") if p.is_file()]) == 3 + 3 + 1
    b = server_factory(*args)
    with b.client() as c:
        register(c, "m/mla", mla, world_size=2, rank=1)
        assert lookup(c, ks_m, tokens_a, session=sid("s1")) == 3 * 256
        assert retrieve(c, sid("s1"), 0, 3, rank=1) == {(ch, 0): data(1)(ch, 0) for ch in range(3)}
        assert retrieve(c, sid("s1"), 0, 3, rank=0) == {(ch, 0): data(1)(ch, 0) for ch in range(3)}
        register(c, "m/sw", sw)
        assert lookup(c, ks_s, tokens_b, session=sid("s2")) == 3 * 256
        got = retrieve(c, sid("s2"), 2, 3)
        assert got == {(2, 0): data(2)(2, 0)[: sizes[0]], (2, 1): data(2)(2, 1)[: sizes[1]]}
        assert lookup(c, ks_s, tokens_b[: 2 * 256]) == 0  # no window ends at chunk 2: not bridged

"""query reports presence per tier: an object evicted from L1 still shows in L2."""

from __future__ import annotations

from pathlib import Path

from kvtestkit.kvhelpers import register, store
from kvprotocol import pack_tokens
from l2util import data, prompt, wait_tier


def test_query_shows_l1_and_l2_presence(server_factory, tmp_path: Path) -> None:
    s = server_factory("--l1-size-gb", "0.001", "--l2", f"fs://{tmp_path}/l2")  # 1 MiB: 64 objects
    with s.client() as c:
        ks, _ = register(c)
        target = prompt(4, seed=40)
        store(c, ks, target, data(40))
        wait_tier(c, "puts", 4)
        fields = {"keyspace": ks.to_wire(), "tokens": pack_tokens(target)}
        before = c.call("query", **fields).result
        assert [(ch["l1"], ch["l2"]) for ch in before["chunks"]] == [(1, 1)] * 4
        for seed in range(41, 60):  # push the target out of L1
            store(c, ks, prompt(4, seed=seed), data(seed))
        after = c.call("query", **fields).result
        assert [(ch["l1"], ch["l2"]) for ch in after["chunks"]] == [(0, 1)] * 4
        assert after["prefix_tokens"] == 0  # query reports; it never prefetches
        other = c.call("query", keyspace=ks.to_wire(), tokens=pack_tokens(prompt(2, seed=999))).result
        assert [(ch["l1"], ch["l2"]) for ch in other["chunks"]] == [(0, 0)] * 2


def test_query_with_an_unreachable_tier_reports_l1_only(server_factory) -> None:
    from kvtestkit.serverproc import free_port

    s = server_factory("--l1-size-gb", "0.01", "--l2", f"redis://127.0.0.1:{free_port()}/0")  # nothing there
    with s.client() as c:
        ks, _ = register(c)
        target = prompt(2, seed=70)
        store(c, ks, target, data(70))
        for _ in range(2):  # also once the tier is known to be down
            chunks = c.call("query", keyspace=ks.to_wire(), tokens=pack_tokens(target)).result["chunks"]
            assert [(ch["l1"], "l2" in ch) for ch in chunks] == [(1, False)] * 2

"""Per-group geometry (kvprotocol._geometry) through EngineClient and a real kvserver (chunk unit 64):

* groups with different tokens per chunk fold into one token prefix (the longest covered by all);
* a sliding-window group stores one snapshot of its last window at the end of a store, a hit needs
  exactly that snapshot (not the prefix before the window), and a load writes only the window;
* a recurrent-state group is stored only at a boundary of its own chunk and is usable only there:
  it never bridges a gap.
Every load is compared byte for byte with the blocks that were saved; blocks a load must not write
keep the sentinel."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine_kv_helpers import SENTINEL, Geometry, module_server
from kvconnector.engine_client import EngineClient
from kvtestkit.kvhelpers import lookup as raw_lookup, sid
from kvtestkit.kvhelpers import retrieve as raw_retrieve
from kvprotocol import Client, KeySpace, pack_tokens

server = module_server("--chunk-size", "64")
U, BS = 64, 16
GEO = Geometry("vllm_cpu", chunk_size=U, block_size=BS)
NB = 64  # blocks per group: [0, 32) saved from, [32, 64) loaded into


def _tokens(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 50000, (n,), generator=g).tolist()


def _kv(layouts: list, seed: int) -> list[list[torch.Tensor]]:
    out = []
    for g, _ in enumerate(layouts):
        kv = GEO.random_kv(NB, seed=seed * 10 + g)
        for layer in kv:
            layer[NB // 2 :] = SENTINEL
        out.append(kv)
    return out


def _client(server, model: str, layouts: list, mode: str = "tcp", copy_backend: str = "auto") -> EngineClient:
    return EngineClient(server.url, model, 1, 0, layouts, mode=mode, timeout=10, copy_backend=copy_backend)


PATHS = pytest.mark.parametrize(("mode", "backend"), [("tcp", "auto"), ("shm", "auto"), ("shm", "torch")])


def _l1(server, model: str, layouts: list, tokens: list[int]) -> list[int]:
    with Client(server.url) as c:
        ks = KeySpace.from_layouts(model, 1, layouts)
        return [ch["l1"] for ch in c.call("query", keyspace=ks.to_wire(), tokens=pack_tokens(tokens)).result["chunks"]]


def _same(kv: list[torch.Tensor], blocks: range, shift: int = NB // 2) -> bool:
    return all(torch.equal(layer[b + shift], layer[b]) for layer in kv for b in blocks)


def _untouched(kv: list[torch.Tensor], blocks: range, shift: int = NB // 2) -> bool:
    return all(bool((layer[b + shift] == SENTINEL).all()) for layer in kv for b in blocks)


def _load(c: EngineClient, session: str, tokens: list[int], skip: int, num: int):
    tables = [list(range(NB // 2, NB))] * len(c._link.layouts)
    return c.load(sid(session), tokens, tables, skip, num)


def test_groups_with_different_chunk_sizes_fold_into_one_token_prefix(server) -> None:
    layouts = [GEO.layout(), replace(GEO.layout(), chunk_size=2 * U)]
    kv = _kv(layouts, 1)
    a = _tokens(1, 5 * U)
    with _client(server, "geo/chunks", layouts) as c:
        assert c.register(kv)
        res = c.save(a, [list(range(NB // 2))] * 2)
        assert res.ok, res.error
        # group 0 has 5 objects, group 1 (128 tokens each) 2: one ends at unit 1, one at unit 3
        assert _l1(server, "geo/chunks", layouts, a) == [1, 2, 1, 2, 1]
        assert c.lookup(a).hit_tokens == 4 * U  # unit 4 lacks group 1's object ending at unit 5
        b = a[: 3 * U] + _tokens(2, 2 * U)
        assert c.lookup(b).hit_tokens == 2 * U  # group 1 covers only units 0-1 of b, group 0 three
        assert c.lookup(a, session=sid("s1")).hit_tokens == 4 * U
        res = _load(c, "s1", a, 0, 4 * U - 1)
        assert res.ok, res.error
        for g in range(2):
            assert _same(kv[g], range(16)) and _untouched(kv[g], range(16, 32))


def test_a_layout_chunk_size_must_be_a_multiple_of_the_servers(server) -> None:
    odd = replace(GEO.layout(), chunk_size=96, block_size=16)
    with _client(server, "geo/odd", [odd]) as c:
        c.register(_kv([odd], 2)[0])  # the tensors fit the layout; the server refuses the registration
        res = c.save(_tokens(9, 2 * 96), list(range(NB // 2)))
        assert not res.ok and "multiple of the server chunk_size" in (res.error or "")


@PATHS
def test_sliding_window_stores_and_needs_only_its_last_window(server, mode: str, backend: str) -> None:
    sw = replace(GEO.layout(), kind="sliding", window=40)  # snapshots of ceil(40 / 16) = 3 blocks
    layouts = [GEO.layout(), sw]
    assert sw.blocks_per_chunk == 3 and sw.object_bytes * 4 == GEO.layout().object_bytes * 3
    kv = _kv(layouts, 3)
    a = _tokens(3 + sum(map(ord, mode + backend)), 6 * U)
    with _client(server, "geo/sw", layouts, mode, backend) as c:
        assert c.register(kv)
        assert c.save(a, [list(range(NB // 2))] * 2).ok
        assert _l1(server, "geo/sw", layouts, a) == [1, 1, 1, 1, 1, 2]  # one snapshot, at the end
        assert c.lookup(a).hit_tokens == 6 * U
        # same first 5 units, then other tokens: group 0 covers 5 units, but no window ends there
        b = a[: 5 * U] + _tokens(4, 2 * U)
        assert c.lookup(b).hit_tokens == 0
        assert c.save(a[: 5 * U], [list(range(NB // 2))] * 2).ok  # now a snapshot ends at unit 5
        assert c.lookup(b).hit_tokens == 5 * U
        # a load of the whole hit less one token: all of group 0, only the window of group 1
        assert c.lookup(a, session=sid("s2")).hit_tokens == 6 * U
        res = _load(c, "s2", a, 0, 6 * U - 1)
        assert res.ok, res.error
        assert _same(kv[0], range(24)) and _untouched(kv[0], range(24, 32))
        assert _same(kv[1], range(21, 24)) and _untouched(kv[1], range(21)) and _untouched(kv[1], range(24, 32))


@PATHS
def test_a_window_snapshot_before_token_zero_is_zero_filled(server, mode: str, backend: str) -> None:
    sw = replace(GEO.layout(), kind="sliding", window=100)  # 7 blocks, the first unit has only 4
    kv = _kv([sw], 5)
    a = _tokens(5 + sum(map(ord, mode + backend)), U)
    with _client(server, "geo/sw0", [sw], mode, backend) as c:
        assert c.register(kv[0])
        assert c.save(a, [list(range(NB // 2))]).ok
        ks = KeySpace.from_layouts("geo/sw0", 1, [sw])
        with Client(server.url) as raw:
            assert raw_lookup(raw, ks, a, session=sid(f"raw{mode}{backend}")) == U
            (obj,) = raw_retrieve(raw, f"raw{mode}{backend}", 0, 1).values()
        per_layer = 7 * sw.block_bytes
        for layer in range(sw.num_layers):
            assert obj[layer * per_layer : layer * per_layer + 3 * sw.block_bytes] == bytes(3 * sw.block_bytes)
        assert c.lookup(a, session=sid("s3")).hit_tokens == U
        assert _load(c, "s3", a, 0, U - 1).ok
        assert _same(kv[0], range(4)) and _untouched(kv[0], range(4, 32))


def test_recurrent_state_is_usable_only_at_its_boundary(server) -> None:
    state = replace(GEO.layout(), kind="state", chunk_size=2 * U)  # a state every 128 tokens
    layouts = [GEO.layout(), state]
    kv = _kv(layouts, 6)
    a = _tokens(6, 6 * U)
    with _client(server, "geo/state", layouts) as c:
        assert c.register(kv)
        assert c.save(a[: 5 * U], [list(range(NB // 2))] * 2).ok  # 5 units: no state boundary at the end
        assert c.lookup(a).hit_tokens == 0
        assert c.save(a[: 4 * U], [list(range(NB // 2))] * 2).ok  # the state after 256 tokens
        assert c.save(a, [list(range(NB // 2))] * 2, skip_tokens=5 * U).ok  # and after 384
        assert _l1(server, "geo/state", layouts, a) == [1, 1, 1, 2, 1, 2]
        assert c.lookup(a).hit_tokens == 6 * U
        assert c.lookup(a[: 5 * U] + _tokens(7, U)).hit_tokens == 4 * U  # never bridged to unit 5
        assert c.lookup(a[: 5 * U], session=sid("s4")).hit_tokens == 4 * U
        bad = _load(c, "s4", a, 0, 4 * U - 1)  # a state cannot serve a token before its boundary
        assert not bad.ok and "state" in (bad.error or "")
        assert c.lookup(a[: 5 * U], session=sid("s5")).hit_tokens == 4 * U
        res = _load(c, "s5", a, 0, 4 * U)
        assert res.ok, res.error
        assert _same(kv[0], range(16)) and _untouched(kv[0], range(16, 32))
        assert _same(kv[1], range(8, 16)) and _untouched(kv[1], range(8)) and _untouched(kv[1], range(16, 32))

"""Segment computation: gather from one paged KV cache into objects, scatter into another."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvconnector import _copy_fallback, _kvcopy, layouts, segments
from kvconnector.copy import address_of
from kvconnector.segments import EngineKV, chunk_segments, merge_segments

DTYPES = [torch.float16, torch.float32, torch.bfloat16, torch.int8]
SENTINEL = 0xEE


def per_layer_shape(tag: str, num_blocks: int, bs: int, heads: int, dim: int) -> tuple[int, ...]:
    return {"vllm_cpu": (num_blocks, heads, bs, 2 * dim), "flash_attn": (2, num_blocks, bs, heads, dim),
            "mla": (num_blocks, bs, dim)}[tag]


def block_bytes_of(tag: str, layer: torch.Tensor, b: int) -> bytes:
    """One block of one layer as the object stores it (flash_attn: K run, then V run)."""
    block = layer[:, b] if tag == "flash_attn" else layer[b]
    return block.contiguous().view(torch.uint8).numpy().tobytes()


def make_cache(tag, layers, num_blocks, bs, heads, dim, dtype, stacked, seed):
    shape = per_layer_shape(tag, num_blocks, bs, heads, dim)
    g = torch.Generator().manual_seed(seed)
    full = torch.empty((layers, *shape), dtype=dtype)
    raw = full.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
    return full if stacked else [full[i].clone() for i in range(layers)]


def layer_list(cache) -> list[torch.Tensor]:
    return list(cache) if isinstance(cache, list) else [cache[i] for i in range(cache.shape[0])]


@st.composite
def scenarios(draw: st.DrawFn) -> dict:
    tag = draw(st.sampled_from(["vllm_cpu", "flash_attn", "mla"]))
    bs, bpc, chunks = draw(st.sampled_from([1, 2, 4, 8])), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    need = bpc * chunks
    nb_src, nb_dst = need + draw(st.integers(0, 4)), need + draw(st.integers(0, 4))
    return {
        "tag": tag, "bs": bs, "bpc": bpc, "chunks": chunks, "nb_src": nb_src, "nb_dst": nb_dst,
        "layers": draw(st.integers(1, 4)), "heads": draw(st.integers(1, 3)), "dim": draw(st.integers(1, 6)),
        "dtype": draw(st.sampled_from(DTYPES)),
        "src_stacked": draw(st.booleans()), "dst_stacked": draw(st.booleans()),
        "src_ids": draw(st.permutations(range(nb_src)))[:need],
        "dst_ids": draw(st.permutations(range(nb_dst)))[:need],
        "slots": draw(st.permutations(range(chunks))), "gap": draw(st.integers(0, 40)),
        "backend": draw(st.sampled_from([_kvcopy, _copy_fallback])),
        "merge": draw(st.booleans()), "layerwise": draw(st.booleans()), "seed": draw(st.integers(0, 2**31)),
    }


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios())
def test_gather_then_scatter_into_other_blocks_reproduces_bytes(sc):
    tag, bpc, chunks, n_layers = sc["tag"], sc["bpc"], sc["chunks"], sc["layers"]
    args = (sc["bs"], sc["heads"], sc["dim"], sc["dtype"])
    src = make_cache(tag, n_layers, sc["nb_src"], *args, sc["src_stacked"], sc["seed"])
    dst = make_cache(tag, n_layers, sc["nb_dst"], *args, sc["dst_stacked"], sc["seed"] + 1)
    dst_before = [t.clone() for t in layer_list(dst)]
    layout = layouts.layout_from_tensor(layer_list(src)[0], tag, sc["bs"], sc["bs"] * bpc, n_layers)
    kv_src, kv_dst = EngineKV.from_tensors(layout, src), EngineKV.from_tensors(layout, dst)

    src_ids = np.array(sc["src_ids"], dtype=np.int64).reshape(chunks, bpc)
    dst_ids = np.array(sc["dst_ids"], dtype=np.int64).reshape(chunks, bpc)
    pitch = layout.object_bytes + sc["gap"]
    offsets = np.array(sc["slots"], dtype=np.int64) * pitch + sc["gap"]
    arena = np.full(chunks * pitch + sc["gap"], SENTINEL, dtype=np.uint8)
    base, copy = address_of(arena, writable=True), sc["backend"].batch_copy

    layer_sets = [[i] for i in range(n_layers)] if sc["layerwise"] else [None]
    for layer_set in layer_sets:
        rows = chunk_segments(kv_src, src_ids, offsets, "gather", layers=layer_set, merge=sc["merge"])
        copy(0, base, rows)

    # The object format: [layer][block-in-chunk][block_bytes], K before V inside a flash_attn block.
    src_layers = layer_list(src)
    used = np.zeros(arena.size, dtype=bool)
    for c in range(chunks):
        want = b"".join(block_bytes_of(tag, src_layers[i], int(b)) for i in range(n_layers) for b in src_ids[c])
        assert arena[offsets[c] : offsets[c] + layout.object_bytes].tobytes() == want
        used[offsets[c] : offsets[c] + layout.object_bytes] = True
    assert (arena[~used] == SENTINEL).all()  # gaps between objects untouched

    for layer_set in layer_sets:
        rows = chunk_segments(kv_dst, dst_ids, offsets, "scatter", layers=layer_set, merge=sc["merge"])
        copy(base, 0, rows)

    dst_layers = layer_list(dst)
    targets = {int(b): int(s) for b, s in zip(dst_ids.reshape(-1), src_ids.reshape(-1))}
    for i in range(n_layers):
        for b in range(sc["nb_dst"]):
            got = block_bytes_of(tag, dst_layers[i], b)
            if b in targets:
                assert got == block_bytes_of(tag, src_layers[i], targets[b]), (i, b)
            else:
                assert got == block_bytes_of(tag, dst_before[i], b), ("untouched", i, b)


def _vllm_cache(layers=3, nb=6, stacked=False):
    return make_cache("vllm_cpu", layers, nb, 4, 2, 8, torch.float32, stacked, seed=3)


def test_contiguous_runs_merge():
    stacked = _vllm_cache(layers=3, nb=2, stacked=True)
    lay = layouts.layout_from_tensor(stacked, "vllm_cpu", block_size=4, chunk_size=8)
    kv = EngineKV.from_tensors(lay, stacked)
    # Whole cache == one object: a single memcpy either way.
    assert chunk_segments(kv, [0, 1], 0, "gather").tolist() == [[stacked.data_ptr(), 0, lay.object_bytes]]
    assert chunk_segments(kv, [0, 1], 64, "scatter").tolist() == [[64, stacked.data_ptr(), lay.object_bytes]]
    assert chunk_segments(kv, [0, 1], 0, "gather", merge=False).shape == (6, 3)
    assert chunk_segments(kv, [1, 0], 0, "gather").shape == (6, 3)  # reversed blocks cannot merge

    per_layer = _vllm_cache(layers=3, nb=6)
    kv = EngineKV.from_tensors(lay, per_layer)
    rows = chunk_segments(kv, [[2, 3], [4, 5]], [0, lay.object_bytes], "gather")
    assert rows.shape == (6, 3) and (rows[:, 2] == 2 * lay.block_bytes).all()  # one row per layer per chunk

    fa = make_cache("flash_attn", 2, 4, 4, 2, 8, torch.float16, True, seed=1)
    fl = layouts.layout_from_tensor(fa, "flash_attn", 4, 8)
    rows = chunk_segments(EngineKV.from_tensors(fl, fa), [0, 1], 0, "gather")
    assert rows.shape == (2 * 2 * 2, 3) and (rows[:, 2] == fl.block_bytes // 2).all()  # K, V never merge


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 60), st.integers(0, 8)), max_size=12), st.integers(0, 3))
def test_merge_segments_preserves_the_copy(pieces, shift):
    # Destinations laid end to end (disjoint); sources arbitrary, often continuing each other.
    rows, cursor = [], 0
    for s, n in pieces:
        rows.append((s, cursor, n))
        cursor += n
    table = np.array(rows, dtype=np.int64).reshape(-1, 3)
    src = np.arange(80, dtype=np.uint8)
    a, b = np.zeros(cursor + 1, np.uint8), np.zeros(cursor + 1, np.uint8)
    merged = merge_segments(table)
    _kvcopy.batch_copy(src.ctypes.data, a.ctypes.data, table)
    _kvcopy.batch_copy(src.ctypes.data, b.ctypes.data, merged)
    assert np.array_equal(a, b) and merged.shape[0] <= max(table.shape[0], 0)
    assert merged[:, 2].sum() == table[:, 2].sum()


def test_layerwise_subset_writes_only_its_layer():
    cache = _vllm_cache(layers=3)
    lay = layouts.layout_from_tensor(cache[0], "vllm_cpu", 4, 8, 3)
    kv = EngineKV.from_tensors(lay, cache)
    obj = np.zeros(lay.object_bytes, np.uint8)
    segments.gather(kv, [5, 1], address_of(obj, writable=True), 0, layers=slice(1, 2))
    per_layer = lay.blocks_per_chunk * lay.block_bytes
    assert not obj[:per_layer].any() and not obj[2 * per_layer :].any()
    want = block_bytes_of("vllm_cpu", cache[1], 5) + block_bytes_of("vllm_cpu", cache[1], 1)
    assert obj[per_layer : 2 * per_layer].tobytes() == want


def test_padded_block_stride_from_tensors():
    nb, heads, bs, d2 = 5, 2, 4, 6
    elems = heads * bs * d2
    storage = torch.arange(nb * (elems + 10), dtype=torch.float32)
    padded = storage.as_strided((nb, heads, bs, d2), (elems + 10, bs * d2, d2, 1))
    lay = layouts.layout_from_tensor(padded, "vllm_cpu", bs, bs, 1)
    kv = EngineKV.from_tensors(lay, [padded])
    assert kv.block_stride == (elems + 10) * 4
    obj = np.zeros(lay.object_bytes, np.uint8)
    segments.gather(kv, [3], address_of(obj, writable=True), 0)
    assert obj.tobytes() == padded[3].contiguous().numpy().tobytes()
    with pytest.raises(ValueError):  # a block whose tokens are not contiguous cannot be one run
        EngineKV.from_tensors(lay, [torch.zeros(nb, heads, bs, 2 * d2)[..., ::2]])


def test_segment_validation():
    cache = _vllm_cache(layers=2)
    lay = layouts.layout_from_tensor(cache[0], "vllm_cpu", 4, 8, 2)
    kv = EngineKV.from_tensors(lay, cache)
    ob = lay.object_bytes
    with pytest.raises(ValueError):
        chunk_segments(kv, [0, 6], 0, "gather")  # block id out of range
    with pytest.raises(ValueError):
        chunk_segments(kv, [-1, 0], 0, "gather")
    with pytest.raises(ValueError):
        chunk_segments(kv, [0, 1, 2], 0, "gather")  # wrong blocks per chunk
    with pytest.raises(ValueError):
        chunk_segments(kv, [[0, 1], [2, 3]], [0], "gather")  # one offset for two chunks
    with pytest.raises(ValueError):
        chunk_segments(kv, [[0, 1], [2, 3]], [0, ob - 1], "gather")  # overlapping objects
    with pytest.raises(ValueError):
        chunk_segments(kv, [[0, 1], [1, 3]], [0, ob], "scatter")  # a block written twice
    with pytest.raises(ValueError):
        chunk_segments(kv, [0, 1], -8, "gather")
    with pytest.raises(ValueError):
        chunk_segments(kv, [0, 1], 8, "gather", object_limit=ob)
    with pytest.raises(ValueError):
        chunk_segments(kv, [0, 1], 0, "sideways")
    with pytest.raises(ValueError):
        chunk_segments(kv, [0, 1], 0, "gather", layers=[2])
    # Gathering the same block twice (two reads) and scattering one object twice are fine.
    assert chunk_segments(kv, [[0, 0], [0, 0]], [0, ob], "gather").shape[0] > 0
    assert chunk_segments(kv, [[0, 1], [2, 3]], [0, 0], "scatter").shape[0] > 0


def test_engine_kv_geometry_checks():
    lay = layouts.flash_attn_layout(num_layers=2, num_kv_heads=1, head_dim=4, block_size=2, dtype="float32",
                                    chunk_size=2)
    run = lay.block_bytes // 2
    EngineKV.from_layer_bases(lay, [4096, 8192], num_blocks=4)  # [2, num_blocks, ...] planes
    EngineKV.from_layer_bases(lay, [4096, 8192], 4, block_stride=2 * run, run_stride=run)  # interleaved
    with pytest.raises(ValueError):  # K of block b+1 would overlap V of block b
        EngineKV.from_layer_bases(lay, [4096, 8192], 4, block_stride=run, run_stride=run)
    with pytest.raises(ValueError):
        EngineKV.from_layer_bases(lay, [4096], 4)  # one base for two layers
    with pytest.raises(ValueError):
        EngineKV.from_layer_bases(lay, [0, 8192], 4)
    stacked = EngineKV.from_stacked(lay, 1 << 20, layer_stride=4 * lay.block_bytes, num_blocks=4)
    assert stacked.layer_bases.tolist() == [1 << 20, (1 << 20) + 4 * lay.block_bytes]
    with pytest.raises(ValueError):  # dtype mismatch between layout and tensors
        EngineKV.from_tensors(lay, torch.zeros(2, 2, 4, 2, 1, 4, dtype=torch.float16))

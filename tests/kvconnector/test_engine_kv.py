"""Copy rows (engine_kv.block_rows, the one row builder): gather from one paged KV cache into objects,
scatter into another, with both kernels."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvconnector import _copy_fallback, _kvcopy, layouts
from kvconnector.copy import address_of
from kvconnector.engine_kv import EngineKV, Moves, block_rows, check_blocks, load_moves, merge_segments, save_moves

DTYPES = [torch.float16, torch.float32, torch.bfloat16, torch.int8]
SENTINEL = 0xEE


def chunk_rows(kv: EngineKV, block_ids, obj_addrs, gather: bool) -> np.ndarray:
    """Rows moving whole chunks: chunk c's blocks block_ids[c] <-> the object at obj_addrs[c]."""
    ids = np.asarray(block_ids, dtype=np.int64).reshape(-1, kv.layout.blocks_per_chunk)
    moves = save_moves(ids.reshape(-1), kv.layout.blocks_per_chunk, range(ids.shape[0]))
    return block_rows(kv, np.asarray(obj_addrs, dtype=np.int64).reshape(-1), moves, gather)


def per_layer_shape(tag: str, num_blocks: int, bs: int, heads: int, dim: int) -> tuple[int, ...]:
    return {
        "vllm_cpu": (num_blocks, heads, bs, 2 * dim),
        "flash_attn": (2, num_blocks, bs, heads, dim),
        "mla": (num_blocks, bs, dim),
    }[tag]


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
        "tag": tag,
        "bs": bs,
        "bpc": bpc,
        "chunks": chunks,
        "nb_src": nb_src,
        "nb_dst": nb_dst,
        "layers": draw(st.integers(1, 4)),
        "heads": draw(st.integers(1, 3)),
        "dim": draw(st.integers(1, 6)),
        "dtype": draw(st.sampled_from(DTYPES)),
        "src_stacked": draw(st.booleans()),
        "dst_stacked": draw(st.booleans()),
        "src_ids": draw(st.permutations(range(nb_src)))[:need],
        "dst_ids": draw(st.permutations(range(nb_dst)))[:need],
        "slots": draw(st.permutations(range(chunks))),
        "gap": draw(st.integers(0, 40)),
        "backend": draw(st.sampled_from([_kvcopy, _copy_fallback])),
        "first": draw(st.integers(0, need - 1)),
        "seed": draw(st.integers(0, 2**31)),
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
    addrs = base + offsets

    copy(0, 0, chunk_rows(kv_src, src_ids, addrs, gather=True))

    # The object format: [layer][block-in-chunk][block_bytes], K before V inside a flash_attn block.
    src_layers = layer_list(src)
    used = np.zeros(arena.size, dtype=bool)
    for c in range(chunks):
        want = b"".join(block_bytes_of(tag, src_layers[i], int(b)) for i in range(n_layers) for b in src_ids[c])
        assert arena[offsets[c] : offsets[c] + layout.object_bytes].tobytes() == want
        used[offsets[c] : offsets[c] + layout.object_bytes] = True
    assert (arena[~used] == SENTINEL).all()  # gaps between objects untouched

    # A load that starts at request block `first` (mid-chunk): the blocks before it are never written.
    moves = load_moves(dst_ids.reshape(-1), bpc, 0, sc["first"], bpc * chunks)
    check_blocks(moves, sc["nb_dst"], distinct=True)
    copy(0, 0, block_rows(kv_dst, addrs, moves, gather=False))

    dst_layers = layer_list(dst)
    flat_dst, flat_src = dst_ids.reshape(-1), src_ids.reshape(-1)
    targets = {int(flat_dst[j]): int(flat_src[j]) for j in range(sc["first"], bpc * chunks)}
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
    assert chunk_rows(kv, [0, 1], [4096], True).tolist() == [[stacked.data_ptr(), 4096, lay.object_bytes]]
    assert chunk_rows(kv, [0, 1], [4096], False).tolist() == [[4096, stacked.data_ptr(), lay.object_bytes]]
    assert chunk_rows(kv, [1, 0], [4096], True).shape == (6, 3)  # reversed blocks cannot merge

    per_layer = _vllm_cache(layers=3, nb=6)
    kv = EngineKV.from_tensors(lay, per_layer)
    rows = chunk_rows(kv, [[2, 3], [4, 5]], [4096, 4096 + lay.object_bytes], True)
    assert rows.shape == (6, 3) and (rows[:, 2] == 2 * lay.block_bytes).all()  # one row per layer per chunk

    fa = make_cache("flash_attn", 2, 4, 4, 2, 8, torch.float16, True, seed=1)
    fl = layouts.layout_from_tensor(fa, "flash_attn", 4, 8)
    rows = chunk_rows(EngineKV.from_tensors(fl, fa), [0, 1], [4096], True)
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


def test_window_moves_fill_only_their_slots():
    """A window snapshot (one object, slots from `base`): only the slots of the moved blocks are written."""
    cache = _vllm_cache(layers=3)
    lay = layouts.layout_from_tensor(cache[0], "vllm_cpu", 4, 8, 3)
    kv = EngineKV.from_tensors(lay, cache)
    obj = np.zeros(lay.object_bytes, np.uint8)
    table = np.array([5, 1, 4], dtype=np.int64)
    moves = Moves(np.zeros(1, np.int64), np.ones(1, np.int64), table[2:3])  # block 4 into slot 1
    _kvcopy.batch_copy(0, 0, block_rows(kv, np.array([address_of(obj, writable=True)]), moves, gather=True))
    per_layer = lay.blocks_per_chunk * lay.block_bytes
    for layer in range(3):
        part = obj[layer * per_layer : (layer + 1) * per_layer]
        assert not part[: lay.block_bytes].any()  # slot 0: untouched
        assert part[lay.block_bytes :].tobytes() == block_bytes_of("vllm_cpu", cache[layer], 4)


def test_padded_block_stride_from_tensors():
    nb, heads, bs, d2 = 5, 2, 4, 6
    elems = heads * bs * d2
    storage = torch.arange(nb * (elems + 10), dtype=torch.float32)
    padded = storage.as_strided((nb, heads, bs, d2), (elems + 10, bs * d2, d2, 1))
    lay = layouts.layout_from_tensor(padded, "vllm_cpu", bs, bs, 1)
    kv = EngineKV.from_tensors(lay, [padded])
    assert kv.block_stride == (elems + 10) * 4
    obj = np.zeros(lay.object_bytes, np.uint8)
    _kvcopy.batch_copy(0, 0, chunk_rows(kv, [3], [address_of(obj, writable=True)], True))
    assert obj.tobytes() == padded[3].contiguous().numpy().tobytes()
    with pytest.raises(ValueError):  # a block whose tokens are not contiguous cannot be one run
        EngineKV.from_tensors(lay, [torch.zeros(nb, heads, bs, 2 * d2)[..., ::2]])


def test_move_validation():
    """What a transfer plan refuses before any row is built (the kernels check the rows themselves)."""
    table = np.arange(6, dtype=np.int64)
    check_blocks(save_moves(table, 2, [0, 2]), 6, distinct=True)
    with pytest.raises(ValueError):
        check_blocks(save_moves(np.array([0, 6]), 2, [0]), 6, distinct=False)  # block id out of range
    with pytest.raises(ValueError):
        check_blocks(save_moves(np.array([-1, 0]), 2, [0]), 6, distinct=False)
    with pytest.raises(ValueError):
        check_blocks(save_moves(np.array([0, 1, 1, 3]), 2, [0, 1]), 6, distinct=True)  # a block written twice
    with pytest.raises(ValueError):
        save_moves(table, 2, [3])  # the table does not cover chunk 3
    with pytest.raises(ValueError):
        load_moves(table, 2, 0, 4, 8)  # the load needs 8 table entries
    # Gathering the same block into two objects (two reads) is fine.
    check_blocks(save_moves(np.zeros(4, np.int64), 2, [0, 1]), 6, distinct=False)


def test_engine_kv_geometry_checks():
    lay = layouts.flash_attn_layout(
        num_layers=2, num_kv_heads=1, head_dim=4, block_size=2, dtype="float32", chunk_size=2
    )
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

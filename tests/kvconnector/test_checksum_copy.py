"""The fused copy + per-object checksum: C++ kernel, numpy fallback and kvprotocol.kvsum agree.

An object is assembled from many segments copied by several threads; its checksum must not depend
on the thread count, on where segments or thread ranges cut it, or on which backend computed it.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvconnector import _copy_fallback as fb
from kvconnector import _kvcopy as ext
from kvprotocol.kvsum import kvsum64
from test_copy_kernels import ref_kvsum64

BACKENDS = [pytest.param(ext, id="cpp"), pytest.param(fb, id="fallback")]


def _addr(a: np.ndarray) -> int:
    return int(a.ctypes.data)


@st.composite
def object_plans(draw: st.DrawFn) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]], int]:
    """Objects at random (unaligned) offsets, each cut into random pieces in random order, some left out."""
    n_obj = draw(st.integers(1, 4))
    sizes = [draw(st.integers(0, 3000)) for _ in range(n_obj)]
    objs, pos = [], draw(st.integers(0, 9))
    for size in sizes:
        objs.append((pos, size))
        pos += size + draw(st.integers(0, 20))
    rows, engine = [], 0
    for off, size in objs:
        cuts = sorted(set([0, size] + draw(st.lists(st.integers(0, size), max_size=6))))
        for a, b in itertools.pairwise(cuts):
            if draw(st.integers(0, 5)) == 0:
                continue  # a gap: summed from the object
            rows.append((engine, off + a, b - a))
            engine += b - a + draw(st.integers(0, 3))
    order = draw(st.permutations(range(len(rows))))
    return objs, [rows[i] for i in order], max(pos, 1)


@given(plan=object_plans(), seed=st.sampled_from([0, 1, (1 << 64) - 1]), threads=st.sampled_from([0, 1, 2, 3, 8]))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_gather_checksums_equal_every_implementation(plan, seed, threads):
    objs, rows, arena_size = plan
    engine = np.random.default_rng(len(rows)).integers(0, 256, size=sum(r[2] + 3 for r in rows) + 8, dtype=np.uint8)
    arenas = {}
    results = {}
    for name, be in (("cpp", ext), ("fallback", fb)):
        arena = np.full(arena_size, 0xA5, dtype=np.uint8)
        results[name] = be.copy_checksum(
            _addr(engine),
            _addr(arena),
            np.array(rows, np.int64).reshape(-1, 3),
            np.array(objs, np.int64).reshape(-1, 2),
            "dst",
            threads,
            seed,
        )
        arenas[name] = arena
    assert np.array_equal(arenas["cpp"], arenas["fallback"])
    want = [ref_kvsum64(arenas["cpp"][o : o + n].tobytes(), seed) for o, n in objs]
    assert results["cpp"] == results["fallback"] == want
    assert want == [kvsum64(arenas["cpp"][o : o + n], seed) for o, n in objs]


@pytest.mark.parametrize("threads", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("block", [4096, 8 * 4096 + 8, 65536 + 3])
def test_large_scatter_checksums_independent_of_threads(threads, block):
    """Megabytes, so the C++ kernel really splits the work (and streams); every split gives one answer."""
    rng = np.random.default_rng(block)
    n_obj, per = 6, 8
    size = per * block
    arena = rng.integers(0, 256, size=n_obj * size + 64, dtype=np.uint8)
    objs = np.array([[16 + k * size, size] for k in range(n_obj)], np.int64)
    engine_blocks = rng.permutation(n_obj * per)
    rows = np.array([[16 + i * block, int(b) * block, block] for i, b in enumerate(engine_blocks)], np.int64)
    want = [fb.checksum(_addr(arena) + int(o), int(n)) for o, n in objs]
    for be in (ext, fb):
        engine = np.zeros(n_obj * per * block, np.uint8)
        got = be.copy_checksum(_addr(arena), _addr(engine), rows, objs, "src", threads)
        assert got == want
        for i, b in enumerate(engine_blocks):
            assert np.array_equal(engine[b * block : (b + 1) * block], arena[16 + i * block : 16 + (i + 1) * block])


def test_partial_scatter_sums_the_whole_object():
    """A load that starts mid-object reads only part of it; the checksum still covers all of it."""
    arena = np.arange(4096, dtype=np.uint8)
    engine = np.zeros(4096, np.uint8)
    objs = np.array([[0, 2048], [2048, 2048]], np.int64)
    rows = np.array([[1000, 0, 1048], [2048, 2000, 100]], np.int64)  # object 0 from byte 1000, object 1 partly
    for be in (ext, fb):
        got = be.copy_checksum(_addr(arena), _addr(engine), rows, objs, "src")
        assert got == [kvsum64(arena[:2048]), kvsum64(arena[2048:])]


def test_a_flipped_byte_changes_only_its_objects_checksum():
    arena = np.random.default_rng(3).integers(0, 256, size=3 * 4096, dtype=np.uint8)
    objs = np.array([[k * 4096, 4096] for k in range(3)], np.int64)
    rows = np.array([[k * 4096, k * 4096, 4096] for k in range(3)], np.int64)
    engine = np.zeros_like(arena)
    before = ext.copy_checksum(_addr(arena), _addr(engine), rows, objs, "src")
    arena[4096 + 777] ^= 0x10
    after = ext.copy_checksum(_addr(arena), _addr(engine), rows, objs, "src")
    assert after[0] == before[0] and after[2] == before[2] and after[1] != before[1]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("rows", "objs", "side", "match"),
    [
        ([[0, 0, 16]], [[0, 8], [4, 8]], "dst", "overlap"),
        ([[0, 100, 8]], [[0, 64]], "dst", "no object"),
        ([[0, 0, 16], [32, 8, 8]], [[0, 64]], "dst", "same object bytes"),
        ([[0, 0, 8]], [[0, 64]], "both", "object_side"),
        ([[0, 0, 8]], [[-1, 64]], "dst", "negative"),
        ([[0, 0, 8]], [[0, 64, 3]], "dst", "objects"),
    ],
)
def test_bad_plans_are_refused_before_copying(backend, rows, objs, side, match):
    src = np.ones(256, np.uint8)
    dst = np.zeros(256, np.uint8)
    with pytest.raises(ValueError, match=match):
        backend.copy_checksum(_addr(src), _addr(dst), np.array(rows, np.int64), np.array(objs, np.int64), side)
    assert not dst.any()


def test_segment_running_into_the_next_object_is_cut_there():
    src = np.random.default_rng(5).integers(0, 256, size=64, dtype=np.uint8)
    objs = np.array([[0, 24], [24, 40]], np.int64)
    for be in (ext, fb):
        dst = np.zeros(64, np.uint8)
        got = be.copy_checksum(_addr(src), _addr(dst), np.array([[0, 0, 64]], np.int64), objs, "dst")
        assert got == [kvsum64(src[:24]), kvsum64(src[24:])]

"""The C++ kernels against the numpy fallback and a plain-Python reference, byte for byte."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvconnector import _copy_fallback as fb
from kvconnector import _kvcopy as ext

BACKENDS = [pytest.param(ext, id="cpp"), pytest.param(fb, id="fallback")]
MASK = (1 << 64) - 1


def ref_kvsum64(data: bytes, seed: int = 0) -> int:
    """kvsum64 written straight from its definition (csrc/checksum.h), one word at a time."""
    p1, p2 = 0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F

    def fmix(x: int) -> int:
        x ^= x >> 33
        x = (x * 0xFF51AFD7ED558CCD) & MASK
        x ^= x >> 33
        x = (x * 0xC4CEB9FE1A85EC53) & MASK
        return x ^ (x >> 33)

    n, words = len(data), len(data) // 8
    acc = 0
    for i in range(words):
        w = int.from_bytes(data[8 * i : 8 * i + 8], "little")
        acc = (acc + fmix(w ^ seed ^ (((i + 1) * p1) & MASK))) & MASK
    if n % 8:
        t = int.from_bytes(data[8 * words :], "little")
        acc = (acc + fmix(t ^ seed ^ (((words + 1) * p1) & MASK) ^ p2)) & MASK
    return fmix(acc ^ seed ^ (((n + 1) * p2) & MASK))


@st.composite
def copy_plans(draw: st.DrawFn) -> tuple[bytes, int, list[tuple[int, int, int]]]:
    """A source buffer and segments whose destinations are disjoint (any order, with gaps)."""
    src_len = draw(st.integers(1, 4096))
    src = draw(st.binary(min_size=src_len, max_size=src_len))
    n = draw(st.integers(0, 24))
    pieces = []
    for _ in range(n):
        off = draw(st.integers(0, src_len - 1))
        pieces.append((off, draw(st.integers(0, src_len - off))))
    order = draw(st.permutations(range(n)))
    segs, cursor = [None] * n, 0
    for k in order:
        cursor += draw(st.integers(0, 64))  # gap
        segs[k] = (pieces[k][0], cursor, pieces[k][1])
        cursor += pieces[k][1]
    return src, cursor + draw(st.integers(0, 16)), segs


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=copy_plans(), as_bytes=st.booleans(), threads=st.integers(0, 4))
def test_batch_copy_matches_fallback_and_reference(plan, as_bytes, threads):
    src_bytes, dst_len, segs = plan
    src = np.frombuffer(src_bytes, dtype=np.uint8).copy()
    expected = bytearray(b"\xa5" * dst_len)
    for s, d, n in segs:
        expected[d : d + n] = src_bytes[s : s + n]
    table = np.array(segs, dtype=np.int64).reshape(-1, 3)
    arg = table.tobytes() if as_bytes else table
    results = []
    for backend in (ext, fb):
        dst = np.full(dst_len, 0xA5, dtype=np.uint8)
        copied = backend.batch_copy(src.ctypes.data, dst.ctypes.data, arg, threads)
        assert copied == sum(n for _, _, n in segs)
        results.append(dst.tobytes())
    assert results[0] == results[1] == bytes(expected)


@pytest.mark.parametrize("threads", [0, 1, 2, 3, 5])
def test_large_copy_split_across_threads(threads):
    # Odd segment sizes, one much larger than the rest, so thread ranges start and end mid-segment.
    rng = np.random.default_rng(threads)
    src = rng.integers(0, 256, 9 << 20, dtype=np.uint8)
    sizes = [5 << 20, 1, 777, 123457, 3 << 20]
    src_offs = [0, 7, 100, 9 << 19, 1 << 20]
    dst = np.zeros(sum(sizes) + 4096, dtype=np.uint8)
    rows, cursor = [], 0
    for s, n in reversed(list(zip(src_offs, sizes))):
        rows.append((s, cursor, n))
        cursor += n + 3
    table = np.array(rows, dtype=np.int64)
    assert ext.batch_copy(src.ctypes.data, dst.ctypes.data, table, threads) == sum(sizes)
    for s, d, n in rows:
        assert np.array_equal(dst[d : d + n], src[s : s + n])
    assert not dst[cursor:].any()


_BIG_SRC = np.random.default_rng(11).integers(0, 256, 10 << 20, dtype=np.uint8)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pieces=st.lists(
        st.tuples(st.integers(0, (10 << 20) - 70000), st.integers(0, 70000), st.integers(0, 130)), max_size=12
    ),
    threads=st.integers(0, 3),
)
def test_streaming_path_matches_reference(pieces, threads):
    # An 8 MiB filler row makes the batch large enough for non-temporal stores; the random rows
    # then exercise every alignment and length around the 64-byte and 16 KiB boundaries.
    assert ext.plan_streaming(ext.STREAM_MIN_TOTAL_BYTES)
    rows, cursor = [(3, 0, ext.STREAM_MIN_TOTAL_BYTES)], ext.STREAM_MIN_TOTAL_BYTES
    for src_off, n, gap in pieces:
        cursor += gap
        rows.append((src_off, cursor, n))
        cursor += n
    dst = np.zeros(cursor + 64, dtype=np.uint8)
    ext.batch_copy(_BIG_SRC.ctypes.data, dst.ctypes.data, np.array(rows, dtype=np.int64), threads)
    expected = np.zeros_like(dst)
    for s, d, n in rows:
        expected[d : d + n] = _BIG_SRC[s : s + n]
    assert np.array_equal(dst, expected)


def test_thread_planning():
    assert 1 <= ext.default_threads() <= 8
    assert ext.plan_threads(1000, 0) == 1  # small copies stay on the calling thread
    assert ext.plan_threads(ext.MIN_BYTES_PER_THREAD * 3, 8) == 3
    assert ext.plan_threads(1 << 40, 5) == 5
    assert not ext.plan_streaming(ext.STREAM_MIN_TOTAL_BYTES - 1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "bad",
    [
        np.zeros((2, 2), dtype=np.int64),  # wrong second dimension
        np.zeros((2, 3, 1), dtype=np.int64),  # wrong rank
        np.zeros(4, dtype=np.int64),  # 1-D, not a multiple of 3
        np.zeros((2, 3), dtype=np.int32),  # wrong dtype
        np.zeros((2, 3), dtype=np.uint64),  # unsigned
        np.zeros((2, 3), dtype=np.float64),
        np.zeros((1, 3), dtype=">i8"),  # big-endian
        np.array([[0, 0, -1]], dtype=np.int64),  # negative length
        np.array([[0, 0, 1], [-5, 0, 1]], dtype=np.int64),  # negative offset
        b"\x00" * 23,  # not whole triples
    ],
    ids=["shape", "rank", "1d", "int32", "uint64", "float", "bigendian", "neglen", "negoff", "bytes23"],
)
def test_bad_segment_arrays_raise_value_error(backend, bad):
    src = np.zeros(64, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    with pytest.raises(ValueError):
        backend.batch_copy(src.ctypes.data, dst.ctypes.data, bad)
    assert not dst.any()  # nothing moved


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_bases_and_threads_raise(backend):
    buf = np.zeros(16, dtype=np.uint8)
    one = np.array([[0, 0, 4]], dtype=np.int64)
    for args in [(-1, buf.ctypes.data, one), (buf.ctypes.data, -8, one), (0, buf.ctypes.data, one)]:
        with pytest.raises(ValueError):
            backend.batch_copy(*args)
    with pytest.raises(ValueError):
        backend.batch_copy(buf.ctypes.data, buf.ctypes.data, np.zeros((0, 3), np.int64), -1)
    # Absolute addresses with a zero base are fine; an empty table copies nothing.
    assert backend.batch_copy(0, 0, np.zeros((0, 3), np.int64)) == 0


@settings(max_examples=150, deadline=None)
@given(data=st.binary(max_size=300), pad=st.integers(0, 7), seed=st.integers(0, MASK))
def test_checksum_matches_reference_unaligned(data, pad, seed):
    buf = np.zeros(len(data) + pad + 8, dtype=np.uint8)
    buf[pad : pad + len(data)] = np.frombuffer(data, dtype=np.uint8)
    addr = buf.ctypes.data + pad  # deliberately not 8-byte aligned when pad != 0
    want = ref_kvsum64(data, seed)
    assert ext.checksum(addr, len(data), seed) == want
    assert fb.checksum(addr, len(data), seed) == want
    assert ext.checksum_bytes(data, seed) == fb.checksum_bytes(data, seed) == want


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=2000), seed=st.integers(0, MASK))
def test_every_compiled_checksum_version_agrees(data, seed):
    versions = ext._checksum_versions(data, seed)
    assert versions[-1][0] == "base" and len(versions) >= 1
    want = ref_kvsum64(data, seed)
    assert all(value == want for _, value in versions), versions


def test_checksum_large_buffer_ext_equals_fallback():
    rng = np.random.default_rng(7)
    data = rng.integers(0, 256, (5 << 20) + 3, dtype=np.uint8)  # crosses the fallback's step size
    for seed in (0, 12345):
        assert ext.checksum_bytes(data, seed) == fb.checksum_bytes(data, seed)
        assert ext.checksum(data.ctypes.data + 1, data.size - 1, seed) == fb.checksum(
            data.ctypes.data + 1, data.size - 1, seed
        )


def test_checksum_sensitivity():
    base = bytes(range(256)) * 4
    h = ext.checksum_bytes(base)
    flipped = bytearray(base)
    flipped[517] ^= 0x10
    swapped = base[8:16] + base[:8] + base[16:]
    seen = {
        h,
        ext.checksum_bytes(flipped),
        ext.checksum_bytes(swapped),
        ext.checksum_bytes(base + b"\0"),
        ext.checksum_bytes(base, seed=1),
        ext.checksum_bytes(b""),
        ext.checksum_bytes(b"\0" * 8),
    }
    assert len(seen) == 7
    assert ext.checksum_bytes(b"") != 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_checksum_argument_errors(backend):
    with pytest.raises(ValueError):
        backend.checksum(0, 8)
    with pytest.raises(ValueError):
        backend.checksum(-1, 0)
    with pytest.raises(ValueError):  # non-contiguous buffers are refused, not silently copied
        backend.checksum_bytes(np.zeros((4, 4), np.uint8)[:, ::2])
    assert backend.checksum(0, 0) == ref_kvsum64(b"")

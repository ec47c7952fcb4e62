"""`fs://...?direct=1`: files framed so the body sits at a 4 KiB offset, read straight into an
aligned destination with O_DIRECT when the page cache does not hold them, through it when it does.
Either kind of file reads on either kind of tier, whole or in place; a frame that is not zeros is
never served. Real files on the test's file system, a real server for the round trip."""

from __future__ import annotations

import asyncio
import mmap
import os
from pathlib import Path

import pytest
from kvserver.l2.base import Landed
from kvserver.l2.fs import FsAdapter
from kvserver.l2.fs_direct import ALIGN, PageCacheProbe
from kvserver.l2.serde import HEADER_BYTES, CorruptObject, Serde
from kvtestkit.kvhelpers import lookup, retrieve, sid
from kvtestkit.pagecache import drop_cache
from l2util import data, object_keys, tier, store_in_l2

SIZES = [1 << 20, 64 * 1024 + 100, 4096]  # a whole number of blocks, a partial last block, one page
SERDE = Serde(hash_landed=True)
needs_cachestat = pytest.mark.skipif(not PageCacheProbe().available, reason="cachestat(2) needs Linux 6.5")


def _payloads() -> list[bytes]:
    return [os.urandom(n) for n in SIZES]


def _keys() -> list[str]:
    return [f"kv1/t/m/w1r0/g0/-/{i:04x}" for i in range(len(SIZES))]


def _put(fs: FsAdapter, payloads: list[bytes]) -> None:
    asyncio.run(fs.start())
    asyncio.run(fs.put_parts([(k, SERDE.encode_parts(k, p, 7)) for k, p in zip(_keys(), payloads, strict=True)]))


def _aligned_dests(payloads: list[bytes]) -> list[memoryview]:
    """Page-aligned destinations, as L1 slots are (4 KiB-aligned in the arena)."""
    spans = [(len(p) + ALIGN - 1) // ALIGN * ALIGN for p in payloads]
    region = mmap.mmap(-1, sum(spans))
    view, out, at = memoryview(region), [], 0
    for p, span in zip(payloads, spans, strict=True):
        out.append(view[at : at + len(p)])
        at += span
    return out  # the views keep the mapping alive


def _get_into(fs: FsAdapter, dests: list[memoryview]) -> list[object]:
    return asyncio.run(fs.get_into(_keys(), dests, HEADER_BYTES, SERDE.verify_in_place))


@needs_cachestat
def test_framed_files_land_straight_in_place_from_the_device_and_through_a_warm_cache(tmp_path: Path) -> None:
    fs = FsAdapter(tmp_path / "l2", direct=True)
    payloads = _payloads()
    _put(fs, payloads)
    for key, p in zip(_keys(), payloads, strict=True):
        assert fs.path_of(key).stat().st_size == ALIGN + len(p)  # the body at a 4 KiB offset
    drop_cache([fs.path_of(k) for k in _keys()])
    dests = _aligned_dests(payloads)
    got = _get_into(fs, dests)
    assert all(isinstance(g, Landed) and g.verdict == 7 for g in got)
    assert [bytes(d) for d in dests] == payloads
    assert fs.describe() == {"direct": True, "direct_reads": len(SIZES)}  # none was cached
    for d in dests:
        d[:] = bytes(len(d))
    got = _get_into(fs, dests)  # the O_DIRECT reads left nothing cached; now read them cached
    for key in _keys():
        with open(fs.path_of(key), "rb") as fh:
            fh.read()
    got = _get_into(fs, dests)
    assert all(isinstance(g, Landed) and g.verdict == 7 for g in got)
    assert [bytes(d) for d in dests] == payloads
    assert fs.describe()["direct_reads"] == 2 * len(SIZES)  # the cached round went through the cache


def test_either_tier_reads_either_kind_of_file_in_place_and_whole(tmp_path: Path) -> None:
    payloads = _payloads()
    for written_direct in (True, False):
        root = tmp_path / f"written-{written_direct}"
        _put(FsAdapter(root, direct=written_direct), payloads)
        for read_direct in (True, False):
            fs = FsAdapter(root, direct=read_direct)
            drop_cache([fs.path_of(k) for k in _keys()])
            dests = _aligned_dests(payloads)
            got = _get_into(fs, dests)
            assert all(isinstance(g, Landed) and g.verdict == 7 for g in got), (written_direct, read_direct)
            assert [bytes(d) for d in dests] == payloads
            unaligned = [memoryview(bytearray(len(p) + 1))[1:] for p in payloads]  # no O_DIRECT possible
            assert all(isinstance(g, Landed) for g in _get_into(fs, unaligned))
            assert [bytes(d) for d in unaligned] == payloads
            blobs = asyncio.run(fs.get(_keys()))  # whole: the blob as encoded, the frame removed
            assert [SERDE.decode_object(k, b) for k, b in zip(_keys(), blobs, strict=True)] == [
                (p, 7) for p in payloads
            ]


def test_a_frame_that_is_not_zeros_or_a_wrong_size_is_never_served(tmp_path: Path) -> None:
    fs = FsAdapter(tmp_path / "l2", direct=True)
    payloads = _payloads()
    _put(fs, payloads)
    paths = [fs.path_of(k) for k in _keys()]
    raw = bytearray(paths[0].read_bytes())
    raw[HEADER_BYTES + 10] = 1  # inside the frame's zeros
    paths[0].write_bytes(bytes(raw))
    paths[1].write_bytes(paths[1].read_bytes()[:-1])  # one byte short
    drop_cache(paths)
    dests = _aligned_dests(payloads)
    got = _get_into(fs, dests)
    for g in got[:2]:  # read whole instead, and the decoder refuses them
        assert isinstance(g, bytes)
        with pytest.raises(CorruptObject):
            SERDE.decode_object(_keys()[got.index(g)], g)
    assert isinstance(got[2], Landed) and bytes(dests[2]) == payloads[2]


@needs_cachestat
def test_a_direct_tier_round_trips_through_a_real_server(server_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    root = tmp_path / "l2"
    s = server_factory("--l1-size-gb", "0.02", "--l2", f"fs://{root}?direct=1")
    with s.client() as c:
        ks, tokens = store_in_l2(c, 4, seed=51)
        fs = FsAdapter(root)
        paths = [fs.path_of(k) for k in object_keys(ks, tokens)]
        assert all(p.stat().st_size == ALIGN + len(data(51)(0, 0)) for p in paths)
        assert c.call("clear").result["removed"] == 4
        drop_cache(paths)
        assert lookup(c, ks, tokens, session=sid("back")) == 4 * 256
        assert retrieve(c, "back", 0, 4) == {(ch, 0): data(51)(ch, 0) for ch in range(4)}
        t = tier(c)
        assert t["direct"] is True and t["direct_reads"] == 4 and t["hits"] == 4 and t["corrupt"] == 0

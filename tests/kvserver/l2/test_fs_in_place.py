"""The fs tier's direct path through real kvserver processes: plain blobs (no compression) are
written from the L1 slot and read back straight into one (version 3 files: a 64-byte header and the
payload); damaged or torn files of the right size land in a slot and are refused by the server
(`--l2-verify server`) or by the reader, whose release reports them so the server drops them
(the default); files of the previous format (version 2, BLAKE3) still read."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from blake3 import blake3
from kvprotocol import flows
from kvprotocol import requests as rq
from kvprotocol.kvsum import kvsum64
from kvserver.l2.fs import FsAdapter
from kvserver.l2.serde import HEADER_BYTES, fingerprint
from kvtestkit.httpkv import parse_metrics
from kvtestkit.kvhelpers import lookup, register, retrieve, sid, store
from l2util import SIZE, data, object_keys, prompt, tier, wait_tier, wait_until, store_in_l2

L1 = ("--l1-size-gb", "0.02")


def _checksums(c, session: str, start: int, end: int) -> list[int]:  # type: ignore[no-untyped-def]
    req = rq.Retrieve(session=sid(session), rank=0, start_chunk=start, end_chunk=end, mode="tcp")
    reply, _ = flows.retrieve_leased(c.send, req)
    return [o.checksum for o in reply.objects]


def test_plain_objects_are_stored_as_header_and_payload_and_read_back_identical(server_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    root = tmp_path / "l2"
    s = server_factory("--l1-size-gb", "0.001", "--l2", f"fs://{root}")  # 64 objects of L1
    tokens = prompt(4, seed=21)
    with s.client() as c:
        ks, _ = register(c)
        store(c, ks, tokens, data(21))
        wait_tier(c, "puts", 4)
        fs = FsAdapter(root)
        for ch, key in enumerate(object_keys(ks, tokens)):
            blob = fs.path_of(key).read_bytes()
            assert len(blob) == HEADER_BYTES + SIZE and blob[4] == 3  # version 3, not compressed
            assert blob[HEADER_BYTES:] == data(21)(ch, 0)  # the payload as committed, uncopied
        for seed in range(22, 40):  # push the objects out of L1
            store(c, ks, prompt(4, seed=seed), data(seed))
        assert c.call("describe").result["l1"]["evictions"] > 0
        assert lookup(c, ks, tokens, session=sid("back")) == 4 * 256
        assert retrieve(c, "back", 0, 4) == {(ch, 0): data(21)(ch, 0) for ch in range(4)}
        assert _checksums(c, "back", 0, 4) == [kvsum64(data(21)(ch, 0)) for ch in range(4)]
        t = tier(c)
        assert t["hits"] >= 4 and t["corrupt"] == 0
        assert t["get_bytes"] >= 4 * (HEADER_BYTES + SIZE)


def _damage(root: Path, ks, tokens) -> list[Path]:  # type: ignore[no-untyped-def]
    """Chunks 1-3: damaged bytes behind a sound header; 4: another chunk's object; 5: one byte short."""
    fs = FsAdapter(root)
    paths = [fs.path_of(k) for k in object_keys(ks, tokens)]
    blobs = [p.read_bytes() for p in paths]
    flipped = bytearray(blobs[1])
    flipped[HEADER_BYTES + SIZE // 2] ^= 0x01  # one bit of the payload: same size, lands in the slot
    paths[1].write_bytes(bytes(flipped))
    torn = blobs[2][: HEADER_BYTES + SIZE // 2] + bytes(SIZE - SIZE // 2)  # full size, tail never written
    paths[2].write_bytes(torn)
    header = bytearray(blobs[3])
    header[40] ^= 0x80  # the stored kvsum64: covered by the checksum
    paths[3].write_bytes(bytes(header))
    paths[4].write_bytes(blobs[0])  # chunk 0's object under chunk 4's name
    paths[5].write_bytes(blobs[5][:-1])  # one byte short: read whole, refused
    return paths


def test_damaged_and_torn_files_of_the_right_size_are_misses_never_served(server_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    root = tmp_path / "l2"
    s = server_factory(*L1, "--l2", f"fs://{root}", "--l2-verify", "server")
    with s.client() as c:
        ks, tokens = store_in_l2(c, 6, seed=41)
        paths = _damage(root, ks, tokens)
        assert c.call("clear").result["removed"] == 6
        assert lookup(c, ks, tokens, session=sid("s")) == 256  # only chunk 0 is sound
        assert retrieve(c, "s", 0, 1) == {(0, 0): data(41)(0, 0)}
        t = tier(c)
        assert t["corrupt"] == 5 and t["hits"] == 1
        wait_until(lambda: not any(p.exists() for p in paths[1:]), what="corrupt files deleted")
        c.call("end_session", session=sid("s"))
        c.call("clear")
        assert lookup(c, ks, tokens) == 256  # a later lookup finds nothing more: they stay misses
        assert tier(c)["corrupt"] == 5


def _copy_verified(reply, frames) -> None:  # type: ignore[no-untyped-def]
    """What every reader does with its copy: check each object's kvsum64, report what fails."""
    bad = [o.chunk for o, f in zip(reply.objects, frames, strict=True) if kvsum64(bytes(f)) != o.checksum]
    if bad:
        raise flows.CorruptCopy(f"chunks {bad} failed their kvsum64", bad)


def test_by_default_damaged_bodies_land_and_the_readers_report_drops_them_from_l1_and_l2(
    server_factory, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    root = tmp_path / "l2"
    s = server_factory(*L1, "--l2", f"fs://{root}", http=True)  # --l2-verify reader: no hash of a landed body
    with s.client() as c:
        ks, tokens = store_in_l2(c, 6, seed=43)
        paths = _damage(root, ks, tokens)
        assert c.call("clear").result["removed"] == 6
        # chunks 1-3 land (their headers are sound); chunk 4's header names another key: refused
        assert lookup(c, ks, tokens, session=sid("s")) == 4 * 256
        assert tier(c)["corrupt"] == 2
        req = rq.Retrieve(session=sid("s"), rank=0, start_chunk=0, end_chunk=4, mode="tcp")
        with pytest.raises(flows.CorruptCopy) as failed:
            flows.read_leased(c.send, req, _copy_verified, prove=False)  # the release reports chunks 1-3
        assert failed.value.chunks == [1, 2, 3]
        counters = c.call("describe").result["counters"]
        assert (counters["corrupt_reported"], counters["corrupt_dropped"], counters["corrupt_refuted"]) == (3, 3, 0)
        assert c.call("describe").result["l1"]["leased"] == 0
        wait_until(lambda: not any(p.exists() for p in paths[1:4]), what="damaged files deleted")
        assert paths[0].exists()
        assert lookup(c, ks, tokens) == 256  # out of L1 and L2: only chunk 0 is left
    with s.http() as h:
        samples = parse_metrics(h.get("/metrics").text)
    assert samples[("kvserver_corrupt_reports_total", frozenset({("found", "damaged")}))] == 3
    assert samples[("kvserver_corrupt_reports_total", frozenset({("found", "intact")}))] == 0


def test_a_report_the_server_cannot_confirm_changes_nothing(server_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    s = server_factory(*L1, "--l2", f"fs://{tmp_path / 'l2'}")
    tokens = prompt(3, seed=45)
    with s.client() as c:
        ks, _ = register(c)
        store(c, ks, tokens, data(45))
        for attempt in range(2):
            assert lookup(c, ks, tokens, session=sid(f"liar{attempt}")) == 3 * 256
            rel, _ = c.send(rq.Release(session=sid(f"liar{attempt}"), rank=0, corrupt=[0, 1, 2, 9]), ())
            assert rel.released and rel.dropped == 0
        counters = c.call("describe").result["counters"]
        # checked once: the second claim about the same objects costs no check
        assert (counters["corrupt_reported"], counters["corrupt_dropped"], counters["corrupt_refuted"]) == (3, 0, 3)
        assert lookup(c, ks, tokens, session=sid("after")) == 3 * 256
        assert retrieve(c, "after", 0, 3) == {(ch, 0): data(45)(ch, 0) for ch in range(3)}
        with pytest.raises(Exception, match="corrupt needs rank"):
            c.send(rq.Release(session=sid("after"), corrupt=[0]), ())


def _version_2_blob(key: str, payload: bytes) -> bytes:
    """A blob as the previous release wrote it: 80-byte header with a BLAKE3 checksum."""
    n = len(payload)
    head = struct.pack("<4sBBBx16sQQQ", b"KVL2", 2, 0, 0, fingerprint(key), n, n, kvsum64(payload))
    return head + blake3(head + payload).digest() + payload


def test_files_written_before_the_format_change_still_read(server_factory, tmp_path: Path) -> None:
    root = tmp_path / "l2"
    first = server_factory(*L1, "--l2", f"fs://{root}")
    tokens = prompt(3, seed=51)
    with first.client() as c:
        ks, _ = register(c)
    first.stop()
    fs = FsAdapter(root)
    for ch, key in enumerate(object_keys(ks, tokens)):  # what an older server left in the directory
        path = fs.path_of(key)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.write_bytes(_version_2_blob(key, data(51)(ch, 0)))
        path.chmod(0o600)
    damaged = bytearray(fs.path_of(object_keys(ks, tokens)[2]).read_bytes())
    damaged[-1] ^= 1
    fs.path_of(object_keys(ks, tokens)[2]).write_bytes(bytes(damaged))
    s = server_factory(*L1, "--l2", f"fs://{root}")
    with s.client() as c:
        ks, _ = register(c)
        assert lookup(c, ks, tokens, session=sid("old")) == 2 * 256  # the damaged third is a miss
        assert retrieve(c, "old", 0, 2) == {(ch, 0): data(51)(ch, 0) for ch in range(2)}
        assert _checksums(c, "old", 0, 2) == [kvsum64(data(51)(ch, 0)) for ch in range(2)]
        t = tier(c)
        assert t["hits"] == 2 and t["corrupt"] == 1

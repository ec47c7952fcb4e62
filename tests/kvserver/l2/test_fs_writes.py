"""How the fs tier writes: an unnamed file (O_TMPFILE) in the object's own directory, linked under
its name once whole, so a reader never sees a partial object and nothing is left behind; a lazy blob
is encoded once, by the writer, however many tiers write it."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from kvserver.l2 import Serde
from kvserver.l2.base import LazyBlob
from kvserver.l2.fs import FsAdapter

BIG = 8 << 20  # large enough that a write takes a while


def _key(i: int) -> str:
    return f"kv1/model/0123456789abcdef/w1r0/g0/-/{i:064x}"


def _objects(root: Path) -> list[Path]:
    return [p for p in (root / "objects").rglob("*") if p.is_file()]


async def test_a_reader_never_sees_an_object_being_written(tmp_path: Path) -> None:
    fs = FsAdapter(tmp_path / "l2")
    await fs.start()
    blob = os.urandom(BIG)
    seen: list[int] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            for path in _objects(tmp_path / "l2"):
                try:
                    seen.append(path.stat().st_size)
                except FileNotFoundError:
                    pass

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for i in range(12):
            await fs.put([(_key(i), blob)])
    finally:
        done.set()
        watcher.join()
    assert seen, "the watcher never saw an object"
    assert set(seen) == {BIG}  # whole, or not there at all
    assert not list((tmp_path / "l2" / "tmp").iterdir())
    await fs.close()


async def test_without_unnamed_files_named_temp_files_are_used_and_leave_nothing(tmp_path: Path) -> None:
    fs = FsAdapter(tmp_path / "l2")
    await fs.start()
    await fs.put([(_key(0), b"unnamed")])
    fs.writer.close_proc_fd()  # as without /proc, or on a file system without O_TMPFILE
    await fs.put([(_key(1), b"named"), (_key(0), b"replaced")])
    assert await fs.get([_key(0), _key(1)]) == [b"replaced", b"named"]
    assert len(_objects(tmp_path / "l2")) == 2
    assert not list((tmp_path / "l2" / "tmp").iterdir())
    await fs.close()


async def test_a_lazy_blob_is_encoded_once_for_every_tier_that_writes_it(tmp_path: Path) -> None:
    serde, payload, calls = Serde(), memoryview(os.urandom(4096)), []

    def encode() -> tuple[bytes, bytes | memoryview]:
        calls.append(threading.get_ident())
        return serde.encode_parts(_key(7), payload, 0)

    lazy = LazyBlob(encode)
    tiers = [FsAdapter(tmp_path / "a"), FsAdapter(tmp_path / "b")]
    for fs in tiers:
        await fs.start()
        await fs.put_parts([(_key(7), lazy)])
    assert len(calls) == 1 and calls[0] != threading.get_ident()  # in a writer thread, not the loop
    blobs = [await fs.get([_key(7)]) for fs in tiers]
    assert blobs[0] == blobs[1] and blobs[0][0] is not None
    assert serde.decode(_key(7), blobs[0][0]) == payload


async def test_durable_puts_name_synced_files_in_synced_directories(tmp_path: Path) -> None:
    fs = FsAdapter(tmp_path / "l2", fsync=True)
    await fs.start()
    blobs = [(_key(i), os.urandom(1000 + i)) for i in range(8)]  # spread over several fan-out directories
    await fs.put(blobs)
    await fs.put([(_key(3), b"again")])
    assert await fs.get([k for k, _ in blobs]) == [b if k != _key(3) else b"again" for k, b in blobs]
    assert len(_objects(tmp_path / "l2")) == 8
    await fs.close()

"""Small helpers for tests that speak the raw protocol: layouts, keyspaces, store/retrieve in both modes."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec
import numpy as np

from kvprotocol import Client, KeySpace, LayoutDescriptor, flows, pack_tokens
from kvprotocol import requests as rq
from kvprotocol._shm import ShmMapping
from kvprotocol.kvsum import kvsum64

Mode = Literal["shm", "tcp"]


def tiny_layout(
    chunk_size: int = 256, layers: int = 2, block_bytes: int = 1024, tag: str = "vllm_cpu", dtype: str = "float32"
) -> LayoutDescriptor:
    return LayoutDescriptor(tag, dtype, layers, 32, block_bytes, chunk_size, (block_bytes // 4,))


def register(
    c: Client, model: str = "m", layouts: Sequence[LayoutDescriptor] | None = None, world_size: int = 1, rank: int = 0
) -> tuple[KeySpace, dict]:
    layouts = list(layouts or [tiny_layout()])
    reply = c.call(
        "register_engine", model=model, world_size=world_size, rank=rank, groups=[lay.to_wire() for lay in layouts]
    ).result
    return KeySpace.from_layouts(model, world_size, layouts), reply


def payload(seed: int, size: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


class ArenaMap:
    """The test's own mapping of the server arena (what an engine does in shm mode)."""

    def __init__(self, name: str, size: int) -> None:
        self._map = ShmMapping(name, size)
        self.mm = self._map.mm

    def write(self, offset: int, data: bytes) -> None:
        self.mm[offset : offset + len(data)] = data

    def read(self, offset: int, size: int) -> bytes:
        return self.mm[offset : offset + size]

    def close(self) -> None:
        self._map.close()


def store(
    c: Client,
    ks: KeySpace,
    tokens: Sequence[int],
    data_of,
    *,
    rank: int = 0,
    salt: str = "",
    mode: Mode = "tcp",
    arena: ArenaMap | None = None,
    start_chunk: int = 0,
    commit: bool = True,
    reservation: str | None = None,
    total_chunks: int | None = None,
    tail: bool = False,
) -> dict:
    """Reserve, fill (data_of(chunk, group) -> bytes) and commit (kvprotocol's one store sequence);
    returns the store reply as a map. `tail`: the partial last chunk is stored too (Store.tail)."""
    req = rq.Store(
        keyspace=ks.wire(),
        tokens=pack_tokens(tokens),
        rank=rank,
        salt=salt,
        mode=mode,
        start_chunk=start_chunk,
        reservation=reservation,
        total_chunks=total_chunks,
        tail=tail,
    )
    if not commit:
        return msgspec.to_builtins(c.send(req)[0])

    def fill(_reply, reserved):
        frames, checksums = [], []
        for slot in reserved:
            data = data_of(slot.chunk, slot.group)
            checksums.append(kvsum64(data))
            if mode == "shm":
                assert arena is not None
                arena.write(slot.offset, data)
            else:
                frames.append(data)
        return frames, checksums

    return msgspec.to_builtins(flows.store_and_commit(c.send, req, fill))


SESSION_PAD = "-pad-to-128-bit-length"  # makes a short test name a session id the server accepts


def sid(name: str) -> str:
    """A readable test session name as an id of the length the server requires (22+ chars); names
    that already have it stay as they are, so `sid(sid(x)) == sid(x)`. Real clients use
    kvprotocol.new_session_id() (128 random bits)."""
    return name if len(name) >= 22 else name + SESSION_PAD


def lookup(
    c: Client, ks: KeySpace, tokens: Sequence[int], salt: str = "", session: str | None = None, tails: bool = False
) -> int:
    fields: dict[str, Any] = {"keyspace": ks.to_wire(), "tokens": pack_tokens(tokens), "salt": salt}
    if session:
        fields["session"] = sid(session)
    if tails:
        fields["tails"] = True
    return int(c.call("lookup", **fields).result["hit_tokens"])


def retrieve(
    c: Client, session: str, start: int, end: int, *, rank: int = 0, mode: Mode = "tcp", arena: ArenaMap | None = None
) -> dict[tuple[int, int], bytes]:
    """The objects of chunks [start, end) a session leased; the leases stay (the test releases them)."""
    req = rq.Retrieve(session=sid(session), rank=rank, start_chunk=start, end_chunk=end, mode=mode)
    reply, frames = flows.retrieve_leased(c.send, req)
    out = {}
    for i, obj in enumerate(reply.objects):
        key = (obj.chunk, obj.group)
        if mode == "shm":
            assert arena is not None and obj.offset is not None, "shm mode needs the arena and offsets"
            out[key] = arena.read(obj.offset, obj.size)
        else:
            out[key] = bytes(frames[i])
    return out


def mapped_rss(address: int) -> int:
    """Bytes of this process's mapping that starts at `address` present in its page tables (smaps Rss)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        start = line.split("-", 1)[0]
        if " " in line and all(c in "0123456789abcdef" for c in start) and int(start, 16) == address:
            for field in lines[i + 1 :]:
                if field.startswith("Rss:"):
                    return int(field.split()[1]) * 1024
    raise AssertionError(f"no mapping at {address:#x}")


def process_mapped_rss(pid: int, path: Path) -> int:
    """Bytes of process `pid`'s mappings of the file at `path` present in its page tables (smaps Rss)."""
    rss, inside = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and not head.endswith(":"):  # a mapping's header line: "start-end perms ... path"
            inside = line.rstrip().endswith(f" {path}")
        elif inside and head == "Rss:":
            rss += int(line.split()[1]) * 1024
    return rss


def wait_allocated(path: Path, timeout: float = 30.0) -> int:
    """Wait until every byte of the file at `path` is allocated (a server prefaults on a thread of its
    own); returns its size."""
    size = os.stat(path).st_size
    deadline = time.monotonic() + timeout
    while os.stat(path).st_blocks * 512 < size:
        assert time.monotonic() < deadline, (
            f"{path}: {os.stat(path).st_blocks * 512} of {size} bytes allocated after {timeout:.0f} s"
        )
        time.sleep(0.05)
    return size


def wait_prefaulted(srv: Any, timeout: float = 60.0) -> None:
    """A server started with --prefault: wait until its arena's pages are allocated and its own
    mapping of them stopped growing (it maps them right after allocating), so a measurement does not
    race the background prefault. `srv`: a kvtestkit.serverproc.ServerProc."""
    assert srv.proc is not None
    wait_allocated(srv.arena_path, timeout)
    last, deadline = -1, time.monotonic() + timeout
    while (now := process_mapped_rss(srv.proc.pid, srv.arena_path)) != last and time.monotonic() < deadline:
        last = now
        time.sleep(0.2)


def wait_quarantine_over(c: Client, timeout: float = 30.0) -> None:
    """Until an expired write reservation was swept into quarantine and its quarantine ended (a
    state, polled: a deadline bounds a hang, it is not a timing check)."""
    deadline, seen = time.monotonic() + timeout, False
    while time.monotonic() < deadline:
        l1 = c.call("describe").result["l1"]
        seen = seen or l1["quarantined"] > 0
        if seen and l1["quarantined"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError("the reservation was never quarantined and released")

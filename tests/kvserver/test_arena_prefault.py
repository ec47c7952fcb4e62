"""--prefault: a real server allocates its arenas' shared memory at start, in the background, while
it already serves; without it the segments stay sparse until engines write into them."""

from __future__ import annotations

import os
import time
from pathlib import Path


def allocated(path: Path) -> int:
    return os.stat(path).st_blocks * 512


def test_prefault_allocates_the_whole_arena_while_serving(server_factory) -> None:
    srv = server_factory("--l1-size-gb", "0.1", "--ec-size-gb", "0.01", "--prefault")
    with srv.client() as c:
        assert c.call("ping").result is not None  # serving while (or after) it allocates
    deadline = time.monotonic() + 30
    for seg in (Path(f"/dev/shm/kvserver-{srv.port}"), Path(f"/dev/shm/kvserver-{srv.port}-ec")):
        size = os.stat(seg).st_size  # each segment prefaults on a thread of its own: wait for both
        while allocated(seg) < size:
            assert time.monotonic() < deadline, f"{seg}: {allocated(seg)} of {size} bytes allocated after 30 s"
            time.sleep(0.05)


def test_without_prefault_the_arena_stays_sparse(server_factory) -> None:
    srv = server_factory("--l1-size-gb", "0.1", "--ec-size-gb", "0.01")
    arena = Path(f"/dev/shm/kvserver-{srv.port}")
    with srv.client() as c:
        c.call("ping")
    assert allocated(arena) < os.stat(arena).st_size // 8  # the header page, not the 100 MiB

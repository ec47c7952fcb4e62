"""--prefault: a real server allocates its arenas' shared memory at start, in the background, while
it already serves, and maps it in its own page tables (an L2 prefetch writes into its slots there);
without it the segments stay sparse until engines write into them."""

from __future__ import annotations

import os
from pathlib import Path

import time

from kvtestkit.kvhelpers import process_mapped_rss, wait_allocated


def allocated(path: Path) -> int:
    return os.stat(path).st_blocks * 512


def test_prefault_allocates_the_whole_arena_while_serving(server_factory) -> None:
    srv = server_factory("--l1-size-gb", "0.1", "--ec-size-gb", "0.01", "--prefault")
    with srv.client() as c:
        assert c.call("ping").result is not None  # serving while (or after) it allocates
    for seg in (Path(f"/dev/shm/kvserver-{srv.port}"), Path(f"/dev/shm/kvserver-{srv.port}-ec")):
        wait_allocated(seg)  # each segment prefaults on a thread of its own: wait for both


def test_prefault_maps_the_arena_in_the_servers_own_page_tables(server_factory) -> None:
    srv = server_factory("--l1-size-gb", "0.1", "--ec-size-gb", "0.01", "--prefault")
    arena = Path(f"/dev/shm/kvserver-{srv.port}")
    size = wait_allocated(arena)
    deadline = time.monotonic() + 30  # a state, polled: the deadline bounds a hang, it is no timing check
    while process_mapped_rss(srv.proc.pid, arena) < size:
        assert time.monotonic() < deadline, f"{process_mapped_rss(srv.proc.pid, arena)} of {size} bytes mapped"
        time.sleep(0.05)


def test_without_prefault_the_arena_stays_sparse(server_factory) -> None:
    srv = server_factory("--l1-size-gb", "0.1", "--ec-size-gb", "0.01")
    arena = Path(f"/dev/shm/kvserver-{srv.port}")
    with srv.client() as c:
        c.call("ping")
    assert allocated(arena) < os.stat(arena).st_size // 8  # the header page, not the 100 MiB
    assert process_mapped_rss(srv.proc.pid, arena) < os.stat(arena).st_size // 8

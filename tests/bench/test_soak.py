"""The chaos soak (#40) in CI: `python -m bench.soak --quick` (fixed seed, 90 s of load plus
start-up) must accept no wrong byte and lose no durable object. It fails only on correctness,
never on a timing; the other checks here make sure the soak really exercised what it claims (a run
that loaded nothing or injected no fault would prove nothing)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.soak.__main__ import QUICK_S, QUICK_SEED
from bench.soak.faults import KINDS, schedule
from bench.soak.stack import Redis
from bench.soak.workload import MAX_BLOCKS, SENTINEL, Identity, layer_shape, prompt

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(900)
def test_quick_soak_accepts_no_wrong_bytes_and_loses_no_durable_object(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    run = subprocess.run(
        [sys.executable, "-m", "bench.soak", "--quick", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["wrong_blocks"] == 0
    assert report["durable"]["lost"] == 0, report["durable"]
    assert report["durable"]["checked"] > 0  # the tiers held objects to lose
    assert {f["kind"] for f in report["faults"]} == set(KINDS)
    for op in ("lookup", "load", "save"):
        assert report["ops"][op]["completed"] > 0, report["ops"]
    assert sum(report["hostile"]["sent"].values()) > 0
    assert report["client_crashes"] == []


def test_the_schedule_is_a_function_of_the_seed() -> None:
    a, b, other = schedule(7, 600, 2.0, 5), schedule(7, 600, 2.0, 5), schedule(8, 600, 2.0, 5)
    assert a == b and a != other
    assert {f.kind for f in schedule(QUICK_SEED, QUICK_S, 2.0, 5)} == set(KINDS)  # --quick meets every kind


@pytest.mark.parametrize("tag", ["vllm_cpu", "flash_attn"])
def test_the_reference_check_sees_one_wrong_value_and_another_tenants_bytes(tag: str) -> None:
    tokens = prompt(1, 2, 2)
    mine, theirs = Identity("tenant-a", tag, 1, 0), Identity("tenant-b", tag, 1, 0)
    kv = [torch.full(layer_shape(tag, 2 * MAX_BLOCKS), SENTINEL) for _ in range(2)]
    mine.fill(kv, tokens, 3, MAX_BLOCKS)
    assert mine.wrong_blocks(kv, tokens, 3, MAX_BLOCKS) == 0
    assert theirs.wrong_blocks(kv, tokens, 3, MAX_BLOCKS) == 2 * 3 * 4  # every block: 2 layers x 3 chunks x 4 blocks
    flat = kv[1].view(-1)
    first = int(np.argmax((flat != SENTINEL).numpy()))
    flat[first] += 1.0
    assert mine.wrong_blocks(kv, tokens, 3, MAX_BLOCKS) == 1
    mine.fill(kv, tokens, 4, MAX_BLOCKS)  # a load that wrote past its hit (and rewrote the flipped value)
    assert mine.wrong_blocks(kv, tokens, 3, MAX_BLOCKS) == 2 * 4  # chunk 3's blocks, in both layers


def test_a_mid_write_fault_waits_for_its_target_to_handle_the_signal(tmp_path: Path) -> None:
    """A client respawned after a kill imports torch for seconds before it installs its handlers; a
    SIGUSR1/2 then would kill it by the default action (the 30-minute run's 'exit -12'). The conductor
    signals it only once its current incarnation says ready, and never a dead one."""
    from bench.soak.run import ROLES, Clients

    clients = Clients(tmp_path, server=None, seed=1, deadline=0.0)  # type: ignore[arg-type]
    clients.incarnations[0] = 2
    clients.procs[0] = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert not clients.armable(0, timeout=0.3)  # still starting
        (clients.dir / f"{ROLES[0].name}-1.jsonl.ready").touch()  # an earlier incarnation's word counts not
        assert not clients.armable(0, timeout=0.3)
        (clients.dir / f"{ROLES[0].name}-2.jsonl.ready").touch()
        assert clients.armable(0, timeout=0.3)
        clients.procs[0].kill()
        clients.procs[0].wait()
        (clients.dir / f"{ROLES[0].name}-2.jsonl.ready").unlink()
        assert not clients.armable(0, timeout=5.0)  # a dead client is never signalled
    finally:
        clients.procs[0].kill()
        clients.procs[0].wait()


def test_a_redis_that_cannot_start_ends_the_wait_with_its_reason(tmp_path: Path) -> None:
    """A redis-server that exits (here: its port is taken) ends the wait and says why: the wait for
    a live one is long (a loaded host took 27 s to start a healthy one), so it must not outlast a dead one."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        red = Redis(tmp_path)
        red.port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match="Address already in use"):
            red.start()
        assert red.proc is not None and red.proc.poll() is not None

"""Tensor parallelism with real vLLM (TP=2, one worker process per rank): each rank saves and loads
its own objects, gives back only its own leases, and the output matches a TP=2 recompute."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvprotocol import Client
from kvtestkit.serverproc import ServerFactory
from vllm_cases import MAX_TOKENS, P_LONG, confirmed, kv_config
from kvtestkit.engines.vllm_harness import prompt, run_engine

pytestmark = [pytest.mark.vllm_engine, pytest.mark.timeout(1200)]  # two TP=2 engines, minutes each on 2 cores

TP = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
_RPC_DIRS: list[Path] = []  # tp_env's folders, removed after each test


@pytest.fixture(autouse=True)
def _remove_vllm_dist_segments() -> Iterator[None]:
    """TP workers that exit slowly leave /dev/shm/vllm_dist_* behind: remove the ones this test made."""
    before = set(Path("/dev/shm").glob("vllm_dist_*"))
    yield
    for seg in set(Path("/dev/shm").glob("vllm_dist_*")) - before:
        seg.unlink(missing_ok=True)
    while _RPC_DIRS:
        shutil.rmtree(_RPC_DIRS.pop(), ignore_errors=True)


def tp_env(tmp_path: Path) -> dict[str, str]:
    # vLLM binds ipc:// sockets under this folder, and a Unix socket path has at most 107 bytes: an
    # xdist worker's tmp_path is too long for it, so the folder is short, in /tmp, and leaves with the
    # test's tmp_path (a link there names it)
    rpc = Path(tempfile.mkdtemp(prefix="kv-rpc-"))
    link = tmp_path / "rpc"
    if not link.is_symlink():
        link.symlink_to(rpc)
    _RPC_DIRS.append(rpc)
    return {
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
        "TORCH_COMPILE_DISABLE": "1",
        "VLLM_RPC_BASE_PATH": str(rpc),
    }


def test_tp2_ranks_load_under_their_own_leases(
    model_dir: Path, kvserver_factory: ServerFactory, tmp_path: Path
) -> None:
    server = kvserver_factory()
    env = tp_env(tmp_path)
    ref = run_engine(
        model_dir, [[prompt(P_LONG)]], max_tokens=MAX_TOKENS, env=env, llm_kwargs={**TP, "enable_prefix_caching": False}
    )
    kv = kv_config(server.url)
    a = run_engine(model_dir, [[prompt(P_LONG)]], max_tokens=MAX_TOKENS, kv_transfer_config=kv, llm_kwargs=TP, env=env)
    assert confirmed(a.requests[0].kv_transfer_params, 512)
    b = run_engine(model_dir, [[prompt(P_LONG)]], max_tokens=MAX_TOKENS, kv_transfer_config=kv, llm_kwargs=TP, env=env)
    r = b.requests[0]
    assert r.kv_transfer_params["kvserver"]["load_failed"] is False
    assert r.connector_loaded_tokens == 512
    assert r.token_ids == ref.requests[0].token_ids
    with Client(server.url) as c:
        d = c.call("describe").result
    # two engines x two ranks registered; their entries expire once the processes exited (periodic sweep)
    assert len([e for e in d["engines"] if e["world_size"] == 2]) + d["engines_expired"] == 4
    assert d["sessions"] == 0 and d["l1"]["leased"] == 0  # every rank gave its own leases back
    assert d["counters"]["broken_reads"] == 0 and d["counters"]["expired_sessions"] == 0

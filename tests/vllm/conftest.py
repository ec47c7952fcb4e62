"""Fixtures for the real-vLLM tests: the tiny model, kvservers, and the no-connector reference run.

Engines always run in subprocesses of the .venv-vllm interpreter (scripts/make-vllm-env.sh), so
these tests collect under any interpreter; tests marked `vllm_engine` skip, with the reason, only
when .venv-vllm is missing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtestkit.serverproc import KVServer, ServerFactory
from vllm_cases import MAX_TOKENS, P_GEN, P_LONG, P_SALTED, P_SHARED_ASKS, P_TURN1, TURN2_TEXT
from kvtestkit.engines.vllm_harness import (
    SHARED_CACHE_ENV,
    VLLM_PYTHON,
    EngineRun,
    build_model,
    next_turn,
    prompt,
    run_engine,
    use_engine_zygote,
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "vllm_engine: runs real vLLM engines from .venv-vllm")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:  # real engines take minutes on 2 busy cores: more than the suite's 300 s default
        if item.get_closest_marker("vllm_engine") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(900))
    if VLLM_PYTHON.exists():
        return
    skip = pytest.mark.skip(reason=f"{VLLM_PYTHON} missing: build it with scripts/make-vllm-env.sh")
    for item in items:
        if item.get_closest_marker("vllm_engine"):
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def shared_vllm_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One VLLM_CACHE_ROOT for every engine of the session (vllm_harness.SHARED_CACHE_ENV): vLLM then
    inspects each model class once, not once per engine start."""
    root = tmp_path_factory.mktemp("vllm-cache")
    before = os.environ.get(SHARED_CACHE_ENV)
    os.environ[SHARED_CACHE_ENV] = str(root)
    yield root
    if before is None:
        os.environ.pop(SHARED_CACHE_ENV, None)
    else:
        os.environ[SHARED_CACHE_ENV] = before


@pytest.fixture(scope="session", autouse=True)
def engine_zygote(shared_vllm_cache: Path) -> Iterator[None]:
    """Engines of the session fork from one parent that imported torch and vLLM once
    (vllm_harness.EngineZygote); it starts with the first engine, so tests that run none pay nothing."""
    use_engine_zygote(True)
    yield
    use_engine_zygote(False)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"{VLLM_PYTHON} missing: build it with scripts/make-vllm-env.sh")
    return build_model(tmp_path_factory.mktemp("tiny-llama") / "model")


@pytest.fixture(scope="session")
def reference(model_dir: Path) -> EngineRun:
    """Greedy outputs of every test prompt, no connector, no prefix caching: plain recompute.

    Batches: 0 P_LONG, 1 P_TURN1, 2 turn 2 of P_TURN1, 3 P_SALTED, 4 P_GEN, 5 turn 2 of P_GEN,
    6 the four P_SHARED_ASKS.
    """
    return run_engine(
        model_dir,
        [
            [prompt(P_LONG)],
            [prompt(P_TURN1)],
            [next_turn(1, 0, TURN2_TEXT)],
            [prompt(P_SALTED, "tenant-a")],
            [prompt(P_GEN)],
            [next_turn(4, 0, TURN2_TEXT)],
            [prompt(p) for p in P_SHARED_ASKS],
        ],
        max_tokens=MAX_TOKENS,
        llm_kwargs={"enable_prefix_caching": False},
    )


@pytest.fixture(scope="module")
def kvserver_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerFactory]:
    servers: list[KVServer] = []

    def make(*args: str) -> KVServer:
        log = tmp_path_factory.mktemp("kvserver") / "kvserver.log"
        s = KVServer(log, "--l1-size-gb", "0.25", *args).start()
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.stop()

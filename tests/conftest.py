"""Shared fixtures: real kvserver and coordinator processes on free ports."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any
import os
import secrets
from pathlib import Path

import pytest

from kvtestkit.coordproc import CoordinatorFactory, CoordinatorProc
from kvtestkit.ports import PORT_CLASH
from kvtestkit.serverproc import ServerProc, free_port

ServerFactory = Callable[..., ServerProc]


ARENA_PREFIXES = ("kvserver-", "kvtest", "gpucheck-")  # the segment names tests and benches use


def _remove_dead_arenas() -> None:
    """Arenas that no live server holds, left by an earlier run (a killed server, a bench): a server
    adopts a leftover arena of its size on its port (warm restart), so a test could otherwise find
    another run's objects. A live server holds `<name>.lock`; an arena whose lock can be taken (or
    that has none) is dead. Runs once per worker before its tests, and never touches a held lock."""
    import fcntl

    shm = Path("/dev/shm")
    for seg in shm.iterdir():
        name = seg.name
        if not name.startswith(ARENA_PREFIXES) or name.endswith((".lock", ".journal", "-ec")):
            continue
        lock = shm / f"{name}.lock"
        try:
            fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            fd = -1
        except OSError:
            continue  # not ours to judge
        try:
            if fd >= 0:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # a live server
        try:
            for suffix in ("", ".journal", "-ec", "-ec.journal", ".lock"):  # the lock last, by its holder (us now)
                (shm / f"{name}{suffix}").unlink(missing_ok=True)
        finally:
            if fd >= 0:
                os.close(fd)


@pytest.fixture(scope="session", autouse=True)
def _dead_arenas_removed() -> None:
    _remove_dead_arenas()


@pytest.fixture(scope="session", autouse=True)
def _state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One private credentials directory for the run: servers write their token files there and
    same-user clients (this process, engines, kvcli subprocesses) read them, like a real host."""
    path = tmp_path_factory.mktemp("kvstate") / "state"
    old = os.environ.get("KVSERVER_STATE_DIR")
    os.environ["KVSERVER_STATE_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("KVSERVER_STATE_DIR", None)
    else:
        os.environ["KVSERVER_STATE_DIR"] = old


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[ServerFactory]:
    """Start kvservers: `server_factory("--l1-size-gb", "0.01", http=False)`; all stopped afterwards."""
    started: list[ServerProc] = []

    def make(
        *args: str, http: bool = False, port: int | None = None, env: dict[str, str] | None = None, start: bool = True
    ) -> ServerProc:
        for attempt in range(3):
            proc = ServerProc(
                port or free_port(),
                list(args),
                tmp_path / f"kvserver-{len(started)}.log",
                http_port=free_port() if http else 0,
                env=env or {},
            )
            started.append(proc)
            if not start:
                return proc
            try:
                return proc.start()
            except RuntimeError as exc:
                # a port picked free here can be taken by a parallel test process before the server
                # binds it: pick new ones (only ports chosen here; a test's own port is its business)
                if port is not None or attempt == 2 or not any(s in str(exc) for s in PORT_CLASH):
                    raise
                proc.stop()
        raise AssertionError("unreachable")

    yield make
    for proc in started:
        proc.stop()
        # a server the test killed leaves its segment behind (as a crash would): clean it up
        Path(f"/dev/shm/kvserver-{proc.port}").unlink(missing_ok=True)
        Path(f"/dev/shm/kvserver-{proc.port}.lock").unlink(missing_ok=True)
        Path(f"/dev/shm/kvserver-{proc.port}-ec").unlink(missing_ok=True)
        for left in (".journal", "-ec.journal"):  # a stopped server leaves its segments and journals
            Path(f"/dev/shm/kvserver-{proc.port}{left}").unlink(missing_ok=True)


@pytest.fixture
def server(server_factory: ServerFactory) -> ServerProc:
    return server_factory("--l1-size-gb", "0.25", "--lease-ttl", "30")


@pytest.fixture
def fleet_token(monkeypatch: pytest.MonkeyPatch) -> str:
    """One fleet token for the test: the coordinator's API and instance token, and (through the
    environment) the token of every server and client the test starts, as an operator deploys a fleet."""
    token = f"fleet-{secrets.token_hex(8)}"
    monkeypatch.setenv("KVSERVER_API_TOKEN", token)
    return token


@pytest.fixture
def coordinator_factory(tmp_path: Path, fleet_token: str) -> Iterator[CoordinatorFactory]:
    """Start coordinators: `coordinator_factory("--instance-timeout", "1")`; all stopped afterwards.

    Without `env`, a coordinator gets the test's fleet token; `env={}` starts one with none (it
    then generates its own)."""
    started: list[CoordinatorProc] = []

    def make(
        *args: str, port: int | None = None, env: dict[str, str] | None = None, start: bool = True
    ) -> CoordinatorProc:
        env = {"KVSERVER_API_TOKEN": fleet_token} if env is None else env
        proc = CoordinatorProc(port or free_port(), list(args), tmp_path / f"coordinator-{len(started)}.log", env=env)
        started.append(proc)
        return proc.start() if start else proc

    yield make
    for proc in started:
        proc.stop()


ENGINE_SCOPE = "tests/vllm/"
"""Under xdist (`-n 3`, pyproject.toml) every test under tests/vllm runs on one worker: they share that
worker's engine zygote, tiny model and reference run, and two engines at once would only split the
same 2 cores. The other workers share the rest, one test at a time."""


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's loadscope scheduling with one scope for the engine tests and one per test elsewhere.
    Scopes go out largest first, so the worker that takes the suite's long pole starts at once.
    (Not `--dist loadgroup`: its xdist_group marks rename node ids, which pytest 9.2 ignores.)"""
    from xdist.scheduler import LoadScopeScheduling

    class EngineScopeScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return ENGINE_SCOPE if nodeid.startswith(ENGINE_SCOPE) else nodeid

    return EngineScopeScheduling(config, log)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """Under CI=true a skip means a missing install step, so it is reported as a failure."""
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI") and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under CI (a missing install step?): {reason}"

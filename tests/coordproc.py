"""Start real `kvcli coordinator` processes on free ports for tests, and poll them without sleeps."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from serverproc import BIN, ManagedProcess, free_port

T = TypeVar("T")


def wait_for(probe: Callable[[], T], timeout: float = 10.0, interval: float = 0.05, what: str = "condition") -> T:
    """Poll `probe` until it returns something truthy; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        got = probe()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


@dataclass
class CoordinatorProc(ManagedProcess):
    port: int
    args: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> CoordinatorProc:
        cmd = [str(BIN / "kvcli"), "coordinator", "--port", str(self.port), *self.args]
        env = {k: v for k, v in os.environ.items() if k != "KVSERVER_API_TOKEN"}
        self.proc = self.spawn(cmd, {**env, **self.env})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"coordinator exited with {self.proc.returncode}: {self.log()}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=0.5).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError(f"coordinator did not answer within {timeout}s: {self.log()}")


    def get(self, path: str, **kw: Any) -> httpx.Response:
        return httpx.get(self.url + path, timeout=10, **kw)

    def instances(self) -> list[dict[str, Any]]:
        return list(self.get("/v1/instances").json()["instances"])


CoordinatorFactory = Callable[..., CoordinatorProc]


@pytest.fixture
def coordinator_factory(tmp_path: Path) -> Iterator[CoordinatorFactory]:
    """Start coordinators: `coordinator_factory("--instance-timeout", "1")`; all stopped afterwards."""
    started: list[CoordinatorProc] = []

    def make(*args: str, port: int | None = None, env: dict[str, str] | None = None,
             start: bool = True) -> CoordinatorProc:
        proc = CoordinatorProc(port or free_port(), list(args), tmp_path / f"coordinator-{len(started)}.log",
                               env=env or {})
        started.append(proc)
        return proc.start() if start else proc

    yield make
    for proc in started:
        proc.stop()

"""Start real `kvcli coordinator` processes on free ports for tests and benches, and poll them without sleeps."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
from kvtestkit.serverproc import BIN, ManagedProcess

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

    @property
    def token(self) -> str | None:
        """The coordinator's token: configured in its env, else the one it generated into its default file."""
        from kvprotocol._credentials import default_token

        return self.env.get("KVSERVER_API_TOKEN") or default_token(self.url)

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def get(self, path: str, **kw: Any) -> httpx.Response:
        headers = {**self.auth, **kw.pop("headers", {})}
        kw.setdefault("timeout", 10)
        return httpx.get(self.url + path, headers=headers, **kw)

    def post(self, path: str, **kw: Any) -> httpx.Response:
        headers = {**self.auth, **kw.pop("headers", {})}
        kw.setdefault("timeout", 10)
        return httpx.post(self.url + path, headers=headers, **kw)

    def instances(self) -> list[dict[str, Any]]:
        return list(self.get("/v1/instances").json()["instances"])


CoordinatorFactory = Callable[..., CoordinatorProc]

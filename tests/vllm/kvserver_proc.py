"""A real `kvserver` process from the main workspace venv, for tests that run engines from .venv-vllm.

The engine side (vLLM, torch) and the server live in different virtual envs: the server binary is
always the main workspace's `.venv/bin/kvserver`, whatever interpreter runs the tests.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from kvprotocol import Client, KVProtocolError

REPO_ROOT = Path(__file__).resolve().parents[2]
KVSERVER_BIN = Path(os.environ.get("KVSERVER_BIN", REPO_ROOT / ".venv" / "bin" / "kvserver"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class KVServer:
    def __init__(self, log_path: Path, *args: str) -> None:
        self.port = free_port()
        self.args = list(args)
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> KVServer:
        if not KVSERVER_BIN.exists():
            raise RuntimeError(f"{KVSERVER_BIN} is missing: run `uv sync` in the workspace first")
        cmd = [
            str(KVSERVER_BIN),
            "start",
            "--port",
            str(self.port),
            "--http-port",
            "0",
            "--shm-prefix",
            f"kvtest{self.port}",
            *self.args,
        ]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        with Client(self.url, timeout=0.5) as c:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"kvserver exited with {self.proc.returncode}:\n{self.log()}")
                try:
                    c.call("ping")
                    return self
                except KVProtocolError:
                    time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"kvserver did not answer within {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def kill(self) -> None:
        """Crash the server; its stale shm segment (what a crash leaves) is removed here."""
        self.stop(signal.SIGKILL)
        Path(f"/dev/shm/kvtest{self.port}-{self.port}").unlink(missing_ok=True)
        Path(f"/dev/shm/kvtest{self.port}-{self.port}.lock").unlink(missing_ok=True)
        Path(f"/dev/shm/kvtest{self.port}-{self.port}-ec").unlink(missing_ok=True)


ServerFactory = Callable[..., KVServer]

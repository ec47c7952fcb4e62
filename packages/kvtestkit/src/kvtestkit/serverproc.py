"""Start real `kvserver` processes on free ports for tests and benches (no mocks: real process, real sockets).

One implementation for both virtual envs: under the workspace venv the `kvserver` next to the
interpreter runs; under .venv-vllm (which has no server) the workspace's `.venv/bin/kvserver` does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import httpx

from kvprotocol import Client, KVProtocolError, is_loopback, resolve_token

from kvtestkit.ports import PORT_CLASH, free_port

__all__ = ["BIN", "KVSERVER_BIN", "REPO_ROOT", "KVServer", "ManagedProcess", "ServerFactory", "ServerProc", "free_port"]

BIN = Path(sys.executable).parent
REPO_ROOT = Path(__file__).resolve().parents[4]  # installed editable: packages/kvtestkit/src/kvtestkit/


def _kvserver_bin() -> Path:
    """KVSERVER_BIN if set, else this interpreter's `kvserver`, else the workspace venv's."""
    if env := os.environ.get("KVSERVER_BIN"):
        return Path(env)
    here = BIN / "kvserver"
    return here if here.exists() else REPO_ROOT / ".venv" / "bin" / "kvserver"


KVSERVER_BIN = _kvserver_bin()


class ManagedProcess:
    """Spawn, log, stop and kill one child process (its own session, output to `log_path`)."""

    log_path: Path
    proc: subprocess.Popen[bytes] | None

    def spawn(self, cmd: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        return self.proc

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            if self.proc is not None:
                self._log.close()  # an exited process's log: closed all the same
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
        finally:
            self._log.close()

    def kill(self) -> None:
        self.stop(signal.SIGKILL)


def _shm_prefix(args: list[str]) -> str:
    return args[args.index("--shm-prefix") + 1] if "--shm-prefix" in args else "kvserver"


@dataclass
class ServerProc(ManagedProcess):
    port: int
    args: list[str]
    log_path: Path
    http_port: int = 0
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    bin: Path | None = None  # another `kvserver` than KVSERVER_BIN (a bench's baseline checkout)

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def arena_path(self) -> Path:
        return Path(f"/dev/shm/{_shm_prefix(self.args)}-{self.port}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0, keep_arena: bool = False) -> int | None:
        """Stop the server; a graceful stop leaves its arena for a warm restart, which tests remove
        unless `keep_arena` (a kill leaves it, as a crash does)."""
        rc = super().stop(sig, timeout)
        if sig != signal.SIGKILL and not keep_arena:
            for suffix in ("", ".journal", "-ec", "-ec.journal"):
                Path(f"{self.arena_path}{suffix}").unlink(missing_ok=True)
        return rc

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start(self, timeout: float = 20.0) -> Self:
        exe = self.bin or KVSERVER_BIN
        if not exe.exists():
            raise RuntimeError(f"{exe} is missing: run `uv sync` in the workspace first")
        # the HTTP port always explicit (the default 8080 would collide between parallel servers), and
        # first, so an --http-port among the args (a fleet member's, say) wins
        cmd = [str(exe), "start", "--port", str(self.port), "--http-port", str(self.http_port), *self.args]
        proc = self.spawn(cmd, {**os.environ, **self.env})
        deadline = time.monotonic() + timeout
        while self.curve and not self._pub_path().exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        with Client(self.url, timeout=0.5, server_key=self.server_key) as c:
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    raise RuntimeError(f"kvserver exited with {proc.returncode}: {self.log()}")
                try:
                    c.call("ping")
                    return self
                except KVProtocolError:
                    time.sleep(0.05)
        raise RuntimeError(f"kvserver did not answer within {timeout}s: {self.log()}")

    @property
    def token(self) -> str | None:
        """The configured token (flag or env), else None: clients then read the default token file."""
        if "--api-token" in self.args:
            return self.args[self.args.index("--api-token") + 1]
        return self.env.get("KVSERVER_API_TOKEN") or None

    @property
    def curve(self) -> bool:
        """Does this server encrypt its ZMQ plane (--curve, or a non-loopback --host)?"""
        if "--curve" in self.args or "--no-curve" in self.args:
            return "--curve" in self.args
        host = self.args[self.args.index("--host") + 1] if "--host" in self.args else "127.0.0.1"
        return not is_loopback(host)

    def _pub_path(self) -> Path:
        state = self.env.get("KVSERVER_STATE_DIR") or os.environ["KVSERVER_STATE_DIR"]
        return Path(state) / f"curve-{self.port}.pub"

    @property
    def server_key(self) -> str | None:
        """The server's CURVE public key, which clients of a CURVE server must be given."""
        return self._pub_path().read_text().strip() if self.curve else None

    def http(self, timeout: float = 5.0) -> httpx.Client:
        """An admin API client with this server's token (configured, or from its default file)."""
        token = resolve_token(self.token, self.http_url)
        return httpx.Client(
            base_url=self.http_url, timeout=timeout, headers={"Authorization": f"Bearer {token}"} if token else {}
        )

    def client(self, timeout: float = 5.0) -> Client:
        return Client(self.url, timeout=timeout, token=self.token, server_key=self.server_key)


class KVServer(ServerProc):
    """A server for engine tests and benches: a free port, its own shm prefix (engines of several
    servers on one host never share a segment name), started with `KVServer(log, *args).start()`."""

    def __init__(self, log_path: Path, *args: str) -> None:
        port = free_port()
        super().__init__(port, ["--shm-prefix", f"kvtest{port}", *args], log_path)

    def start(self, timeout: float = 30.0, attempts: int = 3) -> Self:
        """Start; again on a new port while the one picked was taken by a parallel process between
        the pick and the server's bind (the port is this object's own choice, so it may change it)."""
        for attempt in range(attempts):
            try:
                return super().start(timeout)
            except RuntimeError as exc:
                clash = any(s in str(exc) for s in PORT_CLASH) and f":{self.port}" in str(exc)
                if attempt == attempts - 1 or not clash:  # another port's clash is its picker's to retry
                    raise
                self.stop()
                self.port = free_port()
                self.args[:2] = ["--shm-prefix", f"kvtest{self.port}"]
        raise AssertionError("unreachable")

    def kill(self) -> None:
        """Crash the server; its stale shm segment (what a crash leaves) is removed here."""
        super().kill()
        for suffix in ("", ".lock", "-ec", ".journal", "-ec.journal"):
            Path(f"/dev/shm/kvtest{self.port}-{self.port}{suffix}").unlink(missing_ok=True)


ServerFactory = Callable[..., ServerProc]

"""The processes under test: a redis-server with append-only persistence, a small filesystem for
the fs tier, and the kvserver (kill -9 and warm restart on its port), all on loopback."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvtestkit.serverproc import ServerProc, free_port
from kvtestkit.tenants import add_tenant

ADMIN_TOKEN = "soak-admin-token-0123456789abcdef"
START_TIMEOUT_S = 180.0


class Redis:
    """redis-server with appendonly on and appendfsync always: a write it acknowledged survives its
    kill -9, so Redis counts as a persisting tier in the durability check."""

    def __init__(self, workdir: Path) -> None:
        self.dir, self.port = workdir / "redis", free_port()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0?timeout=1"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is missing (scripts/install-system-deps.sh)")
        cmd = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir), "--save", ""]
        cmd += ["--appendonly", "yes", "--appendfsync", "always", "--protected-mode", "yes"]
        log = open(self.dir / "redis.log", "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        # Waits while the process lives: on a loaded host creating the append-only file with
        # fsync took 14 s and the exec itself 13 s, so a short deadline failed a healthy start.
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if self._probe().ping():
                    return
            except redis.RedisError:
                time.sleep(0.1)
        self.kill()
        tail = (self.dir / "redis.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"redis-server did not start on port {self.port}:\n{tail}")

    def _probe(self) -> redis.Redis:
        """A client that gives up at once: a probe that hangs or retries outlives a redis that exited."""
        return redis.Redis(
            host="127.0.0.1",
            port=self.port,
            socket_timeout=0.5,
            socket_connect_timeout=0.5,
            retry=Retry(NoBackoff(), 0),
        )

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def object_keys(self) -> set[str]:
        return {k.decode() for k in self.client().scan_iter(count=1000)}


class SmallFs:
    """The fs tier's directory on a tmpfs of `mib` MiB, so 'filesystem full' is a real ENOSPC. Needs
    the right to mount (root); without it a plain directory is used and the fill fault is skipped."""

    def __init__(self, workdir: Path, mib: int) -> None:
        self.root = workdir / "fs"
        self.root.mkdir(parents=True, exist_ok=True)
        cmd = ["mount", "-t", "tmpfs", "-o", f"size={mib}m,mode=0700", "tmpfs", str(self.root)]
        self.mounted = subprocess.run(cmd, capture_output=True).returncode == 0
        self.filler = self.root / "filler"

    def fill(self) -> int:
        """Write a file until the filesystem is full; returns the bytes it took."""
        written, block = 0, b"\xa5" * (1 << 16)
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            while True:
                written += os.write(fd, block)
        except OSError:
            return written  # ENOSPC: full
        finally:
            os.close(fd)

    def unfill(self) -> None:
        self.filler.unlink(missing_ok=True)

    def objects(self) -> set[str]:
        base = self.root / "objects"
        if not base.exists():
            return set()
        return {str(p.relative_to(base)) for p in base.rglob("*") if p.is_file()}

    def close(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.root)], capture_output=True)


class Server:
    """The kvserver under test; `restart` starts a new process on the same port, which adopts the
    arena and journal a kill -9 left (warm restart)."""

    def __init__(self, workdir: Path, l2: list[str], lease_ttl: float, l1_gb: float = 0.01) -> None:
        self.workdir, self.port, self.http_port = workdir, free_port(), free_port()
        (workdir / "state").mkdir(parents=True, exist_ok=True)
        self.tenants = workdir / "tenants.json"
        self.tokens = {name: add_tenant(self.tenants, name, "--allow-shm") for name in ("tenant-a", "tenant-b")}
        self.args = ["--l1-size-gb", str(l1_gb), "--chunk-size", "64", "--lease-ttl", str(lease_ttl)]
        self.args += ["--shm-prefix", f"soak{self.port}", "--tenants-file", str(self.tenants)]
        self.args += ["--api-token", ADMIN_TOKEN, "--l2-negative-ttl", "0.2"]
        for url in l2:
            self.args += ["--l2", url]
        self.proc: ServerProc | None = None
        self.incarnation = 0

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        p = self.proc.proc if self.proc else None
        return p.pid if p is not None and p.poll() is None else None

    def start(self) -> None:
        self.incarnation += 1
        log = self.workdir / f"kvserver-{self.incarnation}.log"
        env = {"KVSERVER_STATE_DIR": str(self.workdir / "state")}
        self.proc = ServerProc(self.port, self.args, log, self.http_port, env).start(timeout=START_TIMEOUT_S)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()

    def signal(self, sig: int) -> None:
        if self.pid is not None:
            os.kill(self.pid, sig)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
        prefix = f"/dev/shm/soak{self.port}-{self.port}"
        for suffix in ("", ".lock", "-ec", ".journal"):
            Path(prefix + suffix).unlink(missing_ok=True)

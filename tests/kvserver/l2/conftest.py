"""Real backing stores for the L2 tests: redis-server processes (standalone and a 3-node cluster)
and a moto S3 server process, each on free loopback ports. Skipped only when a binary is missing
(and under CI=true a skip fails the run, so a missing install step cannot hide)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
from l2util import S3_ENV, wait_until
from kvtestkit.serverproc import free_port

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
MOTO_SERVER = Path(sys.executable).parent / "moto_server"


def _need_redis() -> None:
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.skip("redis-server/redis-cli not installed (run scripts/install-system-deps.sh)")


@dataclass
class RedisProc:
    """One redis-server process (no persistence); can be stopped and started again on its port."""

    workdir: Path
    port: int = field(default_factory=free_port)
    extra: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def start(self) -> RedisProc:
        self.workdir.mkdir(parents=True, exist_ok=True)
        cmd = [
            str(REDIS_SERVER),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.workdir),
            "--logfile",
            str(self.workdir / "redis.log"),
            *self.extra,
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

        def pong() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {(self.workdir / 'redis.log').read_text()[-2000:]}")
            try:
                with self.client() as c:
                    return bool(c.ping())
            except redis.RedisError:
                return False

        wait_until(pong, 10, what=f"redis-server on {self.port}")
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisProc]:
    _need_redis()
    proc = RedisProc(tmp_path / "redis").start()
    yield proc
    proc.stop()


def _port_pair() -> tuple[int, int]:
    """A free port and a free cluster-bus port."""
    return free_port(), free_port()


@dataclass
class RedisCluster:
    nodes: list[RedisProc]

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def flush(self) -> None:
        for node in self.nodes:
            with node.client() as c:
                c.flushall()

    def keys(self) -> int:
        total = 0
        for node in self.nodes:
            with node.client() as c:
                total += int(c.dbsize())
        return total


@pytest.fixture(scope="session")
def _cluster_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    _need_redis()
    base = tmp_path_factory.mktemp("redis-cluster")
    nodes = []
    for i in range(3):
        port, bus = _port_pair()
        nodes.append(
            RedisProc(
                base / f"n{i}",
                port,
                [
                    "--cluster-enabled",
                    "yes",
                    "--cluster-port",
                    str(bus),
                    "--cluster-config-file",
                    str(base / f"nodes-{i}.conf"),
                    "--cluster-node-timeout",
                    "2000",
                ],
            ).start()
        )
    try:
        subprocess.run(
            [
                str(REDIS_CLI),
                "--cluster",
                "create",
                *[f"127.0.0.1:{n.port}" for n in nodes],
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )

        def healthy() -> bool:
            for n in nodes:
                with n.client() as c:
                    if c.cluster("info").get("cluster_state") != "ok":
                        return False
            return True

        wait_until(healthy, 30, 0.1, what="redis cluster state ok")
        yield RedisCluster(nodes)
    finally:
        for n in nodes:
            n.stop()


@pytest.fixture
def redis_cluster(_cluster_session: RedisCluster) -> RedisCluster:
    """A real 3-primary Redis Cluster (shared by the session, emptied for each test)."""
    _cluster_session.flush()
    return _cluster_session


@dataclass
class MotoS3:
    endpoint: str

    def client(self):  # type: ignore[no-untyped-def]
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )

    def url(self, bucket: str, prefix: str = "kv") -> str:
        return f"s3://{bucket}/{prefix}?endpoint={self.endpoint}&region=us-east-1"


@pytest.fixture(scope="session")
def moto_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoS3]:
    """A moto S3-compatible HTTP server in its own process (not an in-process mock)."""
    if not MOTO_SERVER.exists():
        pytest.skip("moto_server not installed (uv sync installs the dev group)")
    port = free_port()
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "wb")
    proc = subprocess.Popen(
        [str(MOTO_SERVER), "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **S3_ENV},
        start_new_session=True,
    )

    def listening() -> bool:
        if proc.poll() is not None:
            raise RuntimeError("moto_server exited")
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    try:
        wait_until(listening, 30, 0.05, what="moto_server")
        yield MotoS3(f"http://127.0.0.1:{port}")
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture
def s3_bucket(moto_s3: MotoS3, request: pytest.FixtureRequest) -> str:
    """A fresh bucket for one test."""
    name = "kv-" + "".join(ch for ch in request.node.name.lower() if ch.isalnum())[:40] + f"-{free_port()}"
    moto_s3.client().create_bucket(Bucket=name)
    return name

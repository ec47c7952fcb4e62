"""kvcli installs light: a fresh venv with only kvprotocol + kvcli (and their declared dependencies, as
the lock pins them) pings, describes, queries and shows `top --once` against a real server, without
numpy, fastapi, uvicorn, prometheus-client or torch installed at all.

The venv is built offline from uv's cache (the workspace sync filled it), so the test needs no network.
Under CI=true a skip is a failure (tests/conftest.py), so it runs there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvprotocol import Client
from kvtestkit.kvhelpers import register, store, tiny_layout

ROOT = Path(__file__).resolve().parents[2]
ABSENT = (
    "numpy",
    "fastapi",
    "uvicorn",
    "prometheus_client",
    "torch",
    "kvcoordinator",
    "kvserver",
    "kvconnector",
    "boto3",
)
TOKENS = list(range(500, 500 + 600))


def _uv() -> str:
    uv = shutil.which("uv") or str(Path(sys.executable).parent / "uv")
    if not Path(uv).exists():
        pytest.skip("uv is not installed")
    return uv


def _locked_venv(venv: Path, package: str) -> Path:
    """A venv holding exactly `package`'s locked dependencies (no extras, no dev group).

    `uv sync --package` installs from the lock file's URLs, which the workspace's own `uv sync` has
    already cached, so it works offline on a fresh machine (resolving `name==version` against an
    index, as `uv pip install -r` does, would need index pages the cache may not hold).
    """
    cmd = [_uv(), "sync", "--frozen", "--offline", "-q", "--package", package, "--no-dev", "-p", sys.executable]
    env = {**os.environ, "UV_PROJECT_ENVIRONMENT": str(venv)}
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    if done.returncode != 0 and "offline" in done.stderr.lower():
        pytest.skip(f"uv cache lacks a package for an offline install: {done.stderr.strip()[-300:]}")
    assert done.returncode == 0, (cmd, done.stderr[-2000:])
    return venv


@pytest.fixture(scope="module")
def light_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _locked_venv(tmp_path_factory.mktemp("light") / "venv", "kvcli")


def _kvcli(venv: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(venv / "bin" / "kvcli"), *args], capture_output=True, text=True, timeout=60)


def test_heavy_packages_are_not_installed(light_venv: Path) -> None:
    code = f"import importlib.util, json; print(json.dumps([m for m in {ABSENT!r} if importlib.util.find_spec(m)]))"
    out = subprocess.run(
        [str(light_venv / "bin" / "python"), "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert json.loads(out) == []


def test_every_light_command_works_in_the_light_venv(light_venv: Path, server) -> None:
    layout = tiny_layout()
    with Client(server.url) as c:
        ks, _ = register(c, model="m-light", layouts=[layout])
        store(c, ks, TOKENS[:512], lambda ch, g: bytes(layout.object_bytes))

    ping = _kvcli(light_venv, "ping", "--url", server.url, "--json")
    assert ping.returncode == 0, ping.stderr
    assert json.loads(ping.stdout)["zmq"]["protocol"] == 1

    described = _kvcli(light_venv, "describe", "--url", server.url, "--json")
    assert described.returncode == 0, described.stderr
    assert any(e["model"] == "m-light" for e in json.loads(described.stdout)["engines"])

    query = _kvcli(
        light_venv, "query", "--url", server.url, "--model", "m-light", "--json", "--tokens", ",".join(map(str, TOKENS))
    )
    assert query.returncode == 0, query.stderr
    assert json.loads(query.stdout)["keyspaces"][0]["prefix_tokens"] == 512

    top = _kvcli(light_venv, "top", "--url", server.url, "--once", "--interval", "0.1")
    assert top.returncode == 0, top.stderr
    assert server.url.removeprefix("tcp://") in top.stdout

    tokens = ",".join(map(str, TOKENS[:512]))
    for op in ("pin", "unpin"):
        done = _kvcli(light_venv, op, "--url", server.url, "--model", "m-light", "--tokens", tokens, "--json")
        assert done.returncode == 0 and json.loads(done.stdout)["objects"] == 2, done.stderr
    cleared = _kvcli(light_venv, "clear", "--url", server.url, "--yes", "--json")
    assert cleared.returncode == 0 and json.loads(cleared.stdout)["removed"] == 2, cleared.stderr

    bench = _kvcli(light_venv, "bench", "server", "--url", server.url)
    assert bench.returncode == 1 and "kvcli[bench]" in bench.stderr and "Traceback" not in bench.stderr


def test_coordinator_without_its_package_names_what_to_install(light_venv: Path) -> None:
    done = _kvcli(light_venv, "coordinator", "--port", "9")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert done.stderr.startswith("kvcli: ") and "kvcoordinator" in done.stderr


@pytest.fixture(scope="module")
def server_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """kvprotocol + kvserver without any extra: no boto3, redis, zstandard or cryptography."""
    return _locked_venv(tmp_path_factory.mktemp("server") / "venv", "kvserver")


@pytest.mark.parametrize(
    "args,extra",
    [
        (("--l2", "s3://bucket/prefix"), "kvserver[s3]"),
        (("--l2", "redis://127.0.0.1:1/0"), "kvserver[redis]"),
        (("--l2", "fs:///tmp/kv-light-l2", "--l2-compression", "zstd"), "kvserver[zstd]"),
        (("--l2", "fs:///tmp/kv-light-l2", "--l2-encryption-key-file", "KEYFILE"), "kvserver[crypto]"),
    ],
)
def test_a_tier_without_its_extra_is_refused_naming_the_extra(
    server_venv: Path, tmp_path: Path, args: tuple, extra: str
) -> None:
    code = (
        "import importlib.util as u; assert not any(u.find_spec(m) for m in "
        "('boto3', 'redis', 'zstandard', 'cryptography'))"
    )
    subprocess.run([str(server_venv / "bin" / "python"), "-c", code], check=True, timeout=60)
    from kvtestkit.serverproc import free_port

    key = tmp_path / "l2.key"
    key.write_text("00" * 32)
    args = tuple(str(key) if a == "KEYFILE" else a for a in args)
    port = free_port()
    done = subprocess.run(
        [
            str(server_venv / "bin" / "kvserver"),
            "start",
            "--port",
            str(port),
            "--http-port",
            "0",
            "--l1-size-gb",
            "0.01",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={"KVSERVER_STATE_DIR": str(tmp_path / "state"), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode != 0
    assert extra in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    Path(f"/dev/shm/kvserver-{port}").unlink(missing_ok=True)
    Path(f"/dev/shm/kvserver-{port}.lock").unlink(missing_ok=True)

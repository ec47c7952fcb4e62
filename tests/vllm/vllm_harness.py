"""Runs vLLM engines in fresh subprocesses of the .venv-vllm interpreter and reads their JSON results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
VLLM_VENV = Path(os.environ.get("KV_VLLM_VENV", REPO_ROOT / ".venv-vllm"))
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
RUNNER = Path(__file__).resolve().parent / "engine_runner.py"


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
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from tiny_model import TinyLlamaSpec, build_llama; "
            "build_llama(sys.argv[2], TinyLlamaSpec(**json.loads(sys.argv[3])))")
    subprocess.run([str(VLLM_PYTHON), "-c", code, str(Path(__file__).resolve().parent), str(out_dir),
                    json.dumps(spec_kwargs or {})], check=True, capture_output=True, timeout=timeout,
                   env=engine_env(Path(out_dir).parent / "vllm-cache"))
    return Path(out_dir)


def build_adapter(out_dir: Path, base_dir: Path, seed: int, timeout: float = 300) -> Path:
    """Build a random PEFT LoRA adapter for the tiny model (tiny_model.build_lora) with .venv-vllm."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from tiny_model import build_lora; "
            "build_lora(sys.argv[2], sys.argv[3], int(sys.argv[4]))")
    subprocess.run([str(VLLM_PYTHON), "-c", code, str(Path(__file__).resolve().parent), str(out_dir),
                    str(base_dir), str(seed)], check=True, capture_output=True, timeout=timeout,
                   env=engine_env(Path(out_dir).parent / "vllm-cache"))
    return Path(out_dir)


def build_variant(out_dir: Path, builder: str, timeout: float = 300) -> Path:
    """Build a tiny_variants checkpoint (`build_deepseek_v2`, `build_mistral_sw`) with .venv-vllm."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import tiny_variants; "
            "getattr(tiny_variants, sys.argv[3])(sys.argv[2])")
    subprocess.run([str(VLLM_PYTHON), "-c", code, str(Path(__file__).resolve().parent), str(out_dir), builder],
                   check=True, capture_output=True, timeout=timeout,
                   env=engine_env(Path(out_dir).parent / "vllm-cache"))
    return Path(out_dir)


def build_vlm(out_dir: Path, timeout: float = 300) -> Path:
    """Build the tiny Idefics3 of tiny_vlm.py with the .venv-vllm interpreter."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from tiny_vlm import build_idefics3; "
            "build_idefics3(sys.argv[2])")
    subprocess.run([str(VLLM_PYTHON), "-c", code, str(Path(__file__).resolve().parent), str(out_dir)],
                   check=True, capture_output=True, timeout=timeout,
                   env=engine_env(Path(out_dir).parent / "vllm-cache"))
    return Path(out_dir)


def prompt(tokens: list[int], cache_salt: str | None = None,
           lora: tuple[str, int, str] | None = None) -> dict[str, Any]:
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
    env.update({
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CACHE_ROOT": os.environ.get(SHARED_CACHE_ENV) or str(cache_root),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONHASHSEED": "0",
    })
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
    work = Path(tmp_ctx.name) if tmp_ctx else Path(workdir)  # type: ignore[union-attr]
    work.mkdir(parents=True, exist_ok=True)
    try:
        spec = {
            "model": str(model_dir), "block_size": block_size, "max_model_len": max_model_len,
            "max_tokens": max_tokens, "kv_transfer_config": kv_transfer_config,
            "llm_kwargs": llm_kwargs or {}, "batches": batches, **(extra_spec or {}),
        }
        spec_path, result_path = work / "spec.json", work / "result.json"
        result_path.unlink(missing_ok=True)
        spec_path.write_text(json.dumps(spec))
        python = str(VLLM_PYTHON) if VLLM_PYTHON.exists() else sys.executable
        t0 = time.perf_counter()
        proc = subprocess.run(
            [python, str(RUNNER), str(spec_path), str(result_path)],
            env=engine_env(work / "vllm-cache", env), cwd=work, capture_output=True, text=True,
            timeout=timeout,
        )
        total = time.perf_counter() - t0
        log = proc.stdout + proc.stderr
        if proc.returncode != 0 or not result_path.exists():
            raise EngineRunError(f"engine exited with {proc.returncode}:\n{log[-6000:]}")
        raw = json.loads(result_path.read_text())
        out = [
            BatchResult(b["wall_s"], [RequestResult(**r) for r in b["requests"]], b.get("connector_stats"),
                        b.get("encoder_runs"), b.get("ec"))
            for b in raw["batches"]
        ]
        return EngineRun(init_s=raw["init_s"], total_s=total, batches=out, log=log, prometheus=raw.get("prometheus"),
                         async_scheduling=bool(raw.get("async_scheduling")))
    finally:
        if tmp_ctx is not None:
            tmp_ctx.cleanup()

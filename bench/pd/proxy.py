"""Prefill/decode disaggregation with kvserver: a small proxy over two vLLM engines (docs/pd.md).

Each request goes to the prefill engine (kv_role kv_producer) with max_tokens=1: it computes the
prompt's KV and stores its full chunks in kvserver under a whole-request reservation. Then it goes
to the decode engine (kv_role kv_consumer), which loads those chunks, computes only the tail after
the last full chunk, and generates. Engines are bench/pd/engine.py processes (.venv-vllm).

    .venv-vllm/bin/python -m bench.pd.proxy [--requests 16] [--prompt-len 1100] [--max-tokens 16]

starts a kvserver, builds the tiny random Llama, and prints TTFT and throughput of the batch through
prefill+decode against one engine doing both. Timings are printed, never asserted (tiny model, CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
ENGINE_SCRIPT = Path(__file__).resolve().parent / "engine.py"


def kv_config(url: str, role: str, chunk_size: int = 256, **extra: Any) -> dict[str, Any]:
    """kv_transfer_config of one engine of the pair (role: kv_producer, kv_consumer or kv_both)."""
    return {
        "kv_connector": "KVServerConnector",
        "kv_connector_module_path": "kvconnector.vllm",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kvserver_url": url, "chunk_size": chunk_size, **extra},
    }


class Engine:
    """One bench/pd/engine.py process; generate() sends a batch and waits for its answer."""

    def __init__(
        self,
        python: Path | str,
        model: Path,
        kv: dict[str, Any] | None,
        env: dict[str, str],
        log_path: Path,
        block_size: int = 32,
        max_model_len: int = 2048,
        timeout: float = 600,
    ) -> None:
        spec = {"model": str(model), "block_size": block_size, "max_model_len": max_model_len, "kv_transfer_config": kv}
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [str(python), str(ENGINE_SCRIPT), json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )
        self.timeout = timeout
        self.init_s = float(self._read()["init_s"])

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"engine exited (rc={self.proc.poll()}); see {self._log.name}")
        return json.loads(line)

    def _ask(self, msg: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def generate(self, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
        return self._ask({"prompts": prompts, "max_tokens": max_tokens})

    def stats(self) -> dict[str, float]:
        """The connector's counters so far (lookups, hit_tokens, loaded_tokens, saved_chunks, ...)."""
        return self._ask({"stats": True})

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


def run_pd(
    prefill: Engine, decode: Engine, prompts: list[list[int]], max_tokens: int, micro_batch: int = 0
) -> dict[str, Any]:
    """Every request through prefill (max_tokens=1) and then decode; micro-batches pipeline the two.

    A request's TTFT: from the batch's start until its prefill answered, plus the decode engine's
    first-token latency (its load of the stored chunks and the tail's prefill)."""
    size = micro_batch or len(prompts)
    batches = [list(range(i, min(i + size, len(prompts)))) for i in range(0, len(prompts), size)]
    handoff: queue.Queue[tuple[list[int], float] | None] = queue.Queue()
    t0 = time.perf_counter()

    def prefill_all() -> None:
        for idx in batches:
            prefill.generate([prompts[i] for i in idx], 1)
            handoff.put((idx, time.perf_counter() - t0))
        handoff.put(None)

    thread = threading.Thread(target=prefill_all, daemon=True)
    thread.start()
    out: list[dict[str, Any]] = [{} for _ in prompts]
    while (item := handoff.get()) is not None:
        idx, prefilled = item
        reply = decode.generate([prompts[i] for i in idx], max_tokens)
        for i, r in zip(idx, reply["requests"]):
            out[i] = {**r, "ttft_s": prefilled + r["ttft_s"]}
    thread.join()
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "requests": out}


def run_single(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    reply = engine.generate(prompts, max_tokens)
    return {"wall_s": time.perf_counter() - t0, "requests": reply["requests"]}


def summary(run: dict[str, Any], max_tokens: int) -> dict[str, float]:
    ttft = [r["ttft_s"] for r in run["requests"]]
    return {
        "ttft_mean_s": statistics.mean(ttft),
        "ttft_p50_s": statistics.median(ttft),
        "wall_s": run["wall_s"],
        "tokens_per_s": len(ttft) * max_tokens / run["wall_s"],
    }


def engine_env(cache_root: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CACHE_ROOT": str(cache_root),
            "VLLM_NO_USAGE_STATS": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONHASHSEED": "0",
        }
    )
    env.pop("VIRTUAL_ENV", None)
    return env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=1100)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=4)
    args = ap.parse_args()
    from kvtestkit.serverproc import KVServer
    from kvtestkit.engines.tiny_model import build_llama, random_prompt

    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        model = build_llama(tmp / "model")
        env = engine_env(tmp / "vllm-cache")
        prompts = [random_prompt(args.prompt_len, seed=100 + i) for i in range(args.requests)]
        server = KVServer(tmp / "kvserver.log", "--l1-size-gb", "1").start()
        engines: list[Engine] = []
        try:
            single = Engine(sys.executable, model, None, env, tmp / "single.log")
            engines.append(single)
            single.generate([random_prompt(64, seed=9)], 1)  # warm-up
            base = run_single(single, prompts, args.max_tokens)
            single.close()
            prefill = Engine(sys.executable, model, kv_config(server.url, "kv_producer"), env, tmp / "prefill.log")
            decode = Engine(sys.executable, model, kv_config(server.url, "kv_consumer"), env, tmp / "decode.log")
            engines += [prefill, decode]
            for e in (prefill, decode):
                e.generate([random_prompt(64, seed=9)], 1)
            pd = run_pd(prefill, decode, prompts, args.max_tokens, args.micro_batch)
            same = all(a["token_ids"] == b["token_ids"] for a, b in zip(base["requests"], pd["requests"]))
            rows = {"single engine": summary(base, args.max_tokens), "prefill+decode": summary(pd, args.max_tokens)}
            print(
                f"{args.requests} requests x {args.prompt_len} prompt tokens, {args.max_tokens} generated, "
                f"micro-batch {args.micro_batch}; tokens identical: {same}"
            )
            for name, row in rows.items():
                print(
                    f"  {name:15s} TTFT mean {row['ttft_mean_s']:.3f} s  p50 {row['ttft_p50_s']:.3f} s  "
                    f"wall {row['wall_s']:.2f} s  {row['tokens_per_s']:.1f} tok/s"
                )
            print("  decode engine connector:", {k: v for k, v in decode.stats().items() if v})
            print("  decode num_cached_tokens:", sorted({r["num_cached_tokens"] for r in pd["requests"]}))
        finally:
            for e in engines:
                e.close()
            server.stop()


if __name__ == "__main__":
    main()

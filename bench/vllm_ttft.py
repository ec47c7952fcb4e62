"""Time to first token of real vLLM (CPU) on a long prompt: recompute vs. the ways to reuse its KV.

Run with the .venv-vllm interpreter (scripts/make-vllm-env.sh builds it):

    .venv-vllm/bin/python -m bench.vllm_ttft [--prompt-len 4096] [--configs none,example,...]

Every configuration runs its engines in fresh subprocesses (tests/vllm/engine_runner.py), on a random
fp32 Llama (8 layers x hidden 1024, 8 KV heads: 64 KiB of KV per token; `--kv-kib 128`: 16 layers,
128 KiB per token, where the bytes dominate) built locally. TTFT is the
wall time of one `generate` call with max_tokens=1, after a short warm-up request in the same
engine. Configurations:

  none      no connector: the prompt is prefilled from scratch (recompute), then sent again in the
            same engine: vLLM's in-process prefix cache (the lower bound for any reuse)
  example   vLLM's ExampleConnector (safetensors files on disk): engine A stores, a new engine B loads
  offload   vLLM's OffloadingConnector (CPU offloading): does it run on the CPU backend at all?
  kvserver  our KVServerConnector with a real kvserver: engine A stores, a new engine B loads (an L1 hit)
  kvserver-l2       the same with an fs L2 tier: once A's chunks are on disk, the server restarts with
            an empty L1, so B's hit comes from L2 (prefetched into L1, then loaded); page cache warm
  kvserver-l2-cold  the same with the L2 files dropped from the page cache (fsync + POSIX_FADV_DONTNEED)
            before B runs: the disk's speed
  kvserver-l2-cold-direct  the cold one with the tier's `direct=1`: O_DIRECT reads into the L1 slots
  kvserver-l2-nostream, kvserver-l2-cold-nostream  the same two with the connector's stream_l2 off: the
            hit is reported only once the whole prefetch landed in L1, then loaded (the baseline)

The L2 configurations run the server with --prefault (its arena mapped before engine B asks, as in
a server that has run a while) and --l2-prefetch-timeout 10, so a slow (cold) read of the
whole prompt is not cut short by the 0.5 s default (the bytes are what is measured).

Timings are printed, never asserted. This machine kind has 2 cores: other load skews them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvtestkit.kvhelpers import wait_prefaulted
from kvtestkit.pagecache import drop_cache
from kvtestkit.serverproc import KVSERVER_BIN, KVServer, ServerProc
from kvtestkit.engines.tiny_model import BENCH, TinyLlamaSpec, build_llama, random_prompt
from kvtestkit.engines.vllm_harness import VLLM_PYTHON, EngineRun, EngineRunError, prompt, run_engine

BLOCK_SIZE = 64
CONFIGS = (
    "none",
    "example",
    "offload",
    "kvserver",
    "kvserver-l2",
    "kvserver-l2-cold",
    "kvserver-l2-cold-direct",
    "kvserver-l2-nostream",
    "kvserver-l2-cold-nostream",
)
SPECS = {64: BENCH, 128: dataclasses.replace(BENCH, num_layers=16)}  # KiB of fp32 KV per token


def _ttft_engine(
    model: Path,
    prompts: list[list[int]],
    kv: dict[str, Any] | None,
    max_len: int,
    env: dict[str, str] | None = None,
    llm_kwargs: dict[str, Any] | None = None,
) -> EngineRun:
    """One engine: a short warm-up request, then each prompt in its own generate call (max_tokens=1)."""
    warm = random_prompt(64, seed=999)
    batches = [[prompt(warm)]] + [[prompt(p)] for p in prompts]
    return run_engine(
        model,
        batches,
        max_tokens=1,
        block_size=BLOCK_SIZE,
        max_model_len=max_len,
        kv_transfer_config=kv,
        env=env,
        llm_kwargs=llm_kwargs,
        timeout=1200,
    )


def bench_none(model: Path, p: list[int], max_len: int) -> dict[str, Any]:
    run = _ttft_engine(model, [p, p], None, max_len)
    b = run.batches
    return {
        "recompute_s": b[1].wall_s,
        "prefix_cache_s": b[2].wall_s,
        "prefix_cached_tokens": b[2].requests[0].num_cached_tokens,
        "init_s": run.init_s,
        "tokens": [b[1].requests[0].token_ids, b[2].requests[0].token_ids],
    }


def bench_example(model: Path, p: list[int], max_len: int, tmp: Path) -> dict[str, Any]:
    store = tmp / "example-connector"
    store.mkdir(parents=True)
    kv = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(store)},
    }
    a = _ttft_engine(model, [p], kv, max_len)
    b = _ttft_engine(model, [p], kv, max_len)
    disk = sum(f.stat().st_size for f in store.rglob("*") if f.is_file())
    return {
        "store_s": a.batches[1].wall_s,
        "hit_s": b.batches[1].wall_s,
        "hit_cached_tokens": b.batches[1].requests[0].num_cached_tokens,
        "disk_bytes": disk,
        "tokens": [a.batches[1].requests[0].token_ids, b.batches[1].requests[0].token_ids],
    }


def _last_error(log: str) -> str:
    lines = [ln.split("]: ", 1)[-1].strip() for ln in log.splitlines() if "Error:" in ln or "Exception:" in ln]
    return lines[-1] if lines else log.strip().splitlines()[-1]


def bench_offload(model: Path, p: list[int], max_len: int) -> dict[str, Any]:
    """vLLM's two CPU-offloading connectors; on the CPU backend both refuse to start (GPU only)."""
    out: dict[str, Any] = {}
    for name in ("OffloadingConnector", "SimpleCPUOffloadConnector"):
        kv = {"kv_connector": name, "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30}}
        try:
            run = _ttft_engine(model, [p, p], kv, max_len)
        except EngineRunError as exc:
            out[name] = {"runs": False, "error": _last_error(str(exc))}
            continue
        out[name] = {"runs": True, "first_s": run.batches[1].wall_s, "second_s": run.batches[2].wall_s}
    return out


def bench_kvserver(model: Path, p: list[int], max_len: int, tmp: Path) -> dict[str, Any]:
    if not KVSERVER_BIN.exists():
        return {"skipped": f"{KVSERVER_BIN} missing (run `uv sync`)"}
    probe = subprocess.run(
        [str(VLLM_PYTHON), "-c", "import kvconnector.vllm.connector"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        return {"skipped": f"kvconnector.vllm not importable: {probe.stderr.strip().splitlines()[-1:]}"}
    server = KVServer(tmp / "kvserver.log", "--l1-size-gb", "2").start()
    try:
        kv = _kv_config(server.url)
        a = _ttft_engine(model, [p], kv, max_len)
        b = _ttft_engine(model, [p], kv, max_len)
        rb = b.batches[1].requests[0]
        return {
            "store_s": a.batches[1].wall_s,
            "hit_s": b.batches[1].wall_s,
            "hit_cached_tokens": rb.num_cached_tokens,
            "loaded_tokens": rb.connector_loaded_tokens,
            "tokens": [a.batches[1].requests[0].token_ids, rb.token_ids],
        }
    finally:
        server.stop()


def _kv_config(url: str, stream: bool = True) -> dict[str, Any]:
    return {
        "kv_connector": "KVServerConnector",
        "kv_connector_module_path": "kvconnector.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kvserver_url": url, "mode": "auto", "stream_l2": stream},
    }


def _l2_files(root: Path) -> list[Path]:
    return [f for f in root.rglob("*") if f.is_file() and not f.name.startswith(".")]


def bench_kvserver_l2(
    model: Path, p: list[int], max_len: int, tmp: Path, cold: bool, stream: bool = True, direct: bool = False
) -> dict[str, Any]:
    """Engine A stores with an fs L2 below L1; once every chunk is on disk the server restarts on its
    port with an empty L1 (its arena removed), so new engine B's hit is an L2 hit."""
    if not KVSERVER_BIN.exists():
        return {"skipped": f"{KVSERVER_BIN} missing (run `uv sync`)"}
    l2 = Path(tempfile.mkdtemp(prefix="l2-", dir=tmp))
    # --prefault: the restarted server's arena is mapped before engine B asks, as in a server that has
    # run a while; without it the prefetch's first write into each page faults (docs/l2.md)
    url = f"fs://{l2}" + ("?direct=1" if direct else "")
    args = ("--l1-size-gb", "2", "--l2", url, "--l2-prefetch-timeout", "10", "--prefault")
    server = KVServer(tmp / "kvserver-l2.log", *args).start()
    try:
        a = _ttft_engine(model, [p], _kv_config(server.url), max_len)
        chunks = len(p) // 256
        deadline = time.monotonic() + 120
        while len(_l2_files(l2)) < chunks and time.monotonic() < deadline:  # written behind the stores
            time.sleep(0.1)
        on_disk = len(_l2_files(l2))
        server.stop()  # a graceful stop; stop() removes the arena: the next server starts with L1 empty
        server = ServerProc(server.port, server.args, tmp / "kvserver-l2b.log").start()
        wait_prefaulted(server)
        if cold:
            drop_cache(_l2_files(l2))
        b = _ttft_engine(model, [p], _kv_config(server.url, stream), max_len)
        rb = b.batches[1].requests[0]
        return {
            "store_s": a.batches[1].wall_s,
            "hit_s": b.batches[1].wall_s,
            "l2_objects": on_disk,
            "l2_tokens": (rb.kv_transfer_params or {}).get("kvserver", {}).get("l2_tokens"),
            "hit_cached_tokens": rb.num_cached_tokens,
            "loaded_tokens": rb.connector_loaded_tokens,
            "tokens": [a.batches[1].requests[0].token_ids, rb.token_ids],
        }
    finally:
        server.stop()
        shutil.rmtree(l2, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--kv-kib", type=int, choices=sorted(SPECS), default=64, help="KiB of fp32 KV per token")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--model-dir", type=Path, default=None, help="reuse/build the bench model here")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument(
        "--repeat", type=int, default=1, help="run every configuration this many times; the table shows medians"
    )
    args = ap.parse_args()
    configs = [c for c in args.configs.split(",") if c]
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        ap.error(f"unknown configs {sorted(unknown)}")
    max_len = args.prompt_len + 128
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp_s:
        tmp = Path(tmp_s)
        t = time.perf_counter()
        spec = SPECS[args.kv_kib]
        model = build_llama(args.model_dir or tmp / "model", spec)
        print(
            f"model: {spec} ({spec.kv_bytes_per_token_fp32 // 1024} KiB KV/token), "
            f"built in {time.perf_counter() - t:.1f}s",
            flush=True,
        )
        p = random_prompt(args.prompt_len, seed=7, vocab_size=spec.vocab_size)
        runs: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
        for rep in range(args.repeat):
            for c in configs:
                t = time.perf_counter()
                if c == "none":
                    r = bench_none(model, p, max_len)
                elif c == "example":
                    r = bench_example(model, p, max_len, tmp / f"{rep}")
                elif c == "offload":
                    r = bench_offload(model, p, max_len)
                elif c == "kvserver":
                    r = bench_kvserver(model, p, max_len, tmp)
                else:
                    r = bench_kvserver_l2(
                        model, p, max_len, tmp, "cold" in c, stream=not c.endswith("nostream"), direct="direct" in c
                    )
                runs[c].append(r)
                shown = {k: v for k, v in r.items() if k != "tokens"}
                print(f"[{c} #{rep + 1}] {json.dumps(shown)} ({time.perf_counter() - t:.0f}s)", flush=True)
        results = {c: _median(rs) for c, rs in runs.items()}
    _report(results, args.prompt_len, spec, runs)
    if args.json:
        args.json.write_text(json.dumps({"median": results, "runs": runs}, indent=2))
    return 0


def _median(rs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per key: the median of numeric values over the repeats, else the first run's value."""
    out: dict[str, Any] = {}
    for k, v in rs[0].items():
        nums = [r[k] for r in rs if isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool)]
        out[k] = statistics.median(nums) if len(nums) == len(rs) and nums else v
    return out


def _range(runs: list[dict[str, Any]], key: str) -> str:
    nums = [r[key] for r in runs if isinstance(r.get(key), (int, float))]
    return f"[{min(nums):.3f}-{max(nums):.3f}]" if len(nums) > 1 else ""


def _report(results: dict[str, Any], n: int, spec: TinyLlamaSpec, runs: dict[str, list[dict[str, Any]]]) -> None:
    base = results.get("none", {}).get("recompute_s")
    rows: list[tuple[str, float | None, str]] = []
    if "none" in results:
        r = results["none"]
        rows.append(("recompute (no connector)", r["recompute_s"], _range(runs["none"], "recompute_s")))
        rows.append(("in-process prefix cache", r["prefix_cache_s"], f"cached {r['prefix_cached_tokens']}"))
    if "example" in results:
        r = results["example"]
        rows.append(("ExampleConnector store (engine A)", r["store_s"], ""))
        rows.append(
            (
                "ExampleConnector hit (new engine B)",
                r["hit_s"],
                f"cached {r['hit_cached_tokens']}, {r['disk_bytes'] / 2**20:.0f} MiB on disk",
            )
        )
    for name, r in results.get("offload", {}).items():
        if r["runs"]:
            rows.append((f"{name} (same engine, 2nd)", r["second_s"], ""))
        else:
            rows.append((name, None, f"does not run on CPU: {r['error'][:110]}"))
    if "kvserver" in results:
        r = results["kvserver"]
        if "skipped" in r:
            rows.append(("KVServerConnector", None, "skipped: " + r["skipped"][:150]))
        else:
            rows.append(("KVServerConnector store (engine A)", r["store_s"], ""))
            rows.append(
                (
                    "KVServerConnector hit (new engine B)",
                    r["hit_s"],
                    f"cached {r['hit_cached_tokens']}, loaded {r['loaded_tokens']} {_range(runs['kvserver'], 'hit_s')}",
                )
            )
    for name, label in (
        ("kvserver-l2", "page cache warm"),
        ("kvserver-l2-nostream", "warm, stream_l2 off"),
        ("kvserver-l2-cold", "page cache dropped"),
        ("kvserver-l2-cold-direct", "dropped, direct=1"),
        ("kvserver-l2-cold-nostream", "dropped, stream_l2 off"),
    ):
        r = results.get(name)
        if r is None:
            continue
        if "skipped" in r:
            rows.append((f"KVServerConnector L2 hit ({label})", None, "skipped: " + r["skipped"][:150]))
            continue
        l1 = results.get("kvserver", {}).get("hit_s")
        vs_l1 = f", {r['hit_s'] / l1:.2f}x the L1 hit" if l1 else ""
        rows.append(
            (
                f"KVServerConnector L2 hit ({label})",
                r["hit_s"],
                f"loaded {r['loaded_tokens']}, from L2 {r.get('l2_tokens')} ({r['l2_objects']} objects on disk)"
                f"{vs_l1} {_range(runs[name], 'hit_s')}",
            )
        )
    print(
        f"\nTTFT, {n}-token prompt, fp32 Llama {spec.num_layers}x{spec.hidden_size} on CPU "
        f"({spec.kv_bytes_per_token_fp32 // 1024} KiB KV/token); medians [ranges]"
    )
    print(f"{'configuration':<48} {'TTFT s':>8} {'vs recompute':>13}  note")
    for name, secs, note in rows:
        s = f"{secs:8.3f}" if secs is not None else f"{'-':>8}"
        ratio = f"{secs / base:12.3f}x" if secs is not None and base else f"{'-':>13}"
        print(f"{name:<48} {s} {ratio}  {note}")
    toks = [r["tokens"] for r in results.values() if isinstance(r, dict) and "tokens" in r]
    flat = [t for pair in toks for t in pair]
    if flat:
        print(f"first tokens identical across all runs: {all(t == flat[0] for t in flat)}")


if __name__ == "__main__":
    sys.exit(main())

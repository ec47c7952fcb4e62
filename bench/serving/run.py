"""Serving benchmark: several vLLM engines on one host behind a round-robin (or KV-aware) router, with
and without a shared KV cache, on a multi-round chat, a Mooncake trace replay, and a no-reuse workload.

Run with the .venv-vllm interpreter (scripts/make-vllm-env.sh builds it; `uv sync` builds kvserver):

    .venv-vllm/bin/python -m bench.serving            # full run: 4 configurations x 3 rounds (about an hour here)
    .venv-vllm/bin/python -m bench.serving --quick    # smaller workloads, none and kvserver, 3 rounds
    .venv-vllm/bin/python -m bench.serving --smoke    # KVServerConnector only, a handful of requests
    .venv-vllm/bin/python -m bench.serving --quick --configs kvserver --workloads chat \
        --topology per-engine --routers rr,kv,kvscore   # KV-aware routing vs round robin, a kvserver per engine

Every configuration starts its own engines (vLLM's OpenAI server, one OpenMP thread each) on a random
fp32 Llama built locally, each engine's KV cache capped to a share of the run's working set (`--kv-share`,
plan_kv_cache: the same for every configuration), and KVServerConnector configurations their own
kvserver; the workloads then
run one after another on the same engines (their prompts share nothing across workloads). Per
configuration and workload the tables give TTFT p50/p90/p99, ITL p99, request throughput, and where
the prompt tokens came from, from the difference of vLLM's /metrics counters before and after the
workload, summed over the engines (docs/benchmarks.md says exactly how). Timings are printed with
ratios against the no-connector configuration of the same run, never asserted. With `--routers rr,kv`
every configuration runs once per router (fresh engines each time); the KV-aware rows are named
`<config>+kv` (the coordinator's best instance) or `<config>+kvscore` (its hint weighed against load
and the router's memory of each engine) and say how many requests the coordinator routed and how many
fell back. With `--repeats` (3 by default, 1 in --smoke) every figure gets its median and range over
the rounds, its ratio to `none` and a verdict (bench/serving/repeats.py, bench/serving/verdict.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any


from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import bench.serving.engines as eng
import bench.serving.workloads as wl
from bench.serving.client import RequestRecord, delta, kv_cache_blocks, run_workload, scrape
import bench.serving.repeats as serving_repeats
from bench.serving.router import ROUTERS, KvRouter, KvScoreRouter, RoundRobin
from bench.serving.tails import pct, ttft_floor
from kvtestkit.engines.vllm_harness import SHARED_CACHE_ENV, build_model

MODEL = {
    "num_layers": 4,
    "hidden_size": 512,
    "num_heads": 8,
    "num_kv_heads": 4,
    "intermediate_size": 1408,
    "vocab_size": wl.VOCAB,
}
MAX_MODEL_LEN = 4096  # uncapped engines (--kv-share 0); capped ones get the run's longest request
# Each engine's KV cache (so its prefix cache) as a share of the run's working set (plan_kv_cache): a
# deployment's HBM holds a few concurrent long contexts, not a day of conversations.
KV_SHARE = 0.1
# The cache's chunk (kvserver and LMCache alike) in the measured runs: one engine block. A stored
# prompt's last partial chunk is recomputed on the next turn, so a chat turn loses chunk/2 tokens on
# average: with 256 (the connector's default) the chat recomputed 25% of its prompt tokens, with 64 18%.
CHAT_CHUNK = 64
SCALES: dict[str, dict[str, Any]] = {
    "full": {
        "configs": "none,example,kvserver,kvserver-sync,lmcache",  # lmcache: when .venv-lmcache exists
        "workloads": "chat,trace,noreuse,saturate",
        "engines": 3,
        "repeats": 3,
        "kv_share": KV_SHARE,
        "chunk_size": CHAT_CHUNK,
        "chat": dict(users=32, rounds=4, system_tokens=512, user_tokens=128, max_tokens=16, think_s=2.0, stagger_s=0.5),
        "trace": dict(
            conversations=32, block_tokens=32, duration_s=40.0, max_prompt=1024, max_tokens=16, sample="spread"
        ),
        "traceburst": dict(
            conversations=24, block_tokens=32, duration_s=60.0, max_prompt=1024, max_tokens=16, sample="first"
        ),
        "noreuse": dict(requests=96, prompt_tokens=768, max_tokens=16, concurrency=6),  # 48 left its req/s to noise
        "saturate": dict(conversations=24, block_tokens=32, max_prompt=1024, max_tokens=16, concurrency=12),
    },
    "quick": {
        "configs": "none,kvserver",
        "workloads": "chat,trace,noreuse",  # add saturate with --workloads
        "engines": 3,
        "repeats": 3,
        "kv_share": KV_SHARE,
        "chunk_size": CHAT_CHUNK,
        "chat": dict(users=24, rounds=4, system_tokens=512, user_tokens=128, max_tokens=16, think_s=1.0, stagger_s=0.5),
        "trace": dict(
            conversations=16, block_tokens=32, duration_s=30.0, max_prompt=1024, max_tokens=16, sample="spread"
        ),
        "traceburst": dict(
            conversations=16, block_tokens=32, duration_s=30.0, max_prompt=1024, max_tokens=16, sample="first"
        ),
        "noreuse": dict(requests=24, prompt_tokens=512, max_tokens=16, concurrency=6),
        "saturate": dict(conversations=16, block_tokens=32, max_prompt=1024, max_tokens=16, concurrency=12),
    },
    "smoke": {
        "configs": "kvserver",
        "workloads": "chat",
        "engines": 2,
        "repeats": 1,
        "kv_share": KV_SHARE,  # clamped to one request's KV: the capped path runs in the suite too
        "chunk_size": eng.CHUNK_SIZE,  # the connector's default, as the tests expect
        # one user: round k runs on engine k mod 2, so engine 1 must load what engine 0 stored
        "chat": dict(users=1, rounds=4, system_tokens=512, user_tokens=64, max_tokens=8, think_s=0.3, stagger_s=0.0),
        "trace": dict(conversations=2, block_tokens=32, duration_s=5.0, max_prompt=1024, max_tokens=8, sample="spread"),
        "traceburst": dict(
            conversations=2, block_tokens=32, duration_s=5.0, max_prompt=1024, max_tokens=8, sample="first"
        ),
        "noreuse": dict(requests=4, prompt_tokens=256, max_tokens=8, concurrency=2),
        "saturate": dict(conversations=2, block_tokens=32, max_prompt=1024, max_tokens=8, concurrency=4),
    },
}


def plan_kv_cache(workloads: dict[str, wl.Workload], share: float) -> dict[str, Any]:
    """Each engine's KV cache for a run (wl.plan_kv_cache), for this benchmark's model and block size."""
    return wl.plan_kv_cache(workloads, share, eng.BLOCK_SIZE, kv_bytes_per_token(), MAX_MODEL_LEN)


def kv_bytes_per_token() -> int:
    """K and V of every layer, fp32: 2 x layers x KV heads x head size x 4 bytes."""
    return 2 * MODEL["num_layers"] * MODEL["num_kv_heads"] * (MODEL["hidden_size"] // MODEL["num_heads"]) * 4


def describe_plan(plan: dict[str, Any], engines: int) -> str:
    if plan["blocks"] is None:
        return f"engine KV caches uncapped (--kv-share 0); working set {plan['working_set_tokens']} tokens"
    sets = ", ".join(f"{n} {plan['working_sets'][n]} tokens ({100 * plan['shares'][n]:.0f}%)" for n in plan["shares"])
    return (
        f"engine KV cache {plan['cache_tokens']} tokens ({plan['cache_mib']:.1f} MiB, {plan['blocks']} blocks "
        f"incl. the null block) per engine, x{engines} engines, the same for every configuration: "
        f"--kv-share {plan['share']} of the working set {plan['working_set_tokens']} tokens"
        + (f", CLAMPED to the longest request ({plan['longest_request']} tokens)" if plan["clamped"] else "")
        + f"; per workload: {sets}; max-model-len {plan['max_model_len']}"
    )


def describe_reachable(reachable: dict[str, float], grain: int) -> str:
    return (
        f"reuse reachable at {grain}-token blocks (every earlier request's full blocks stored at once and "
        "kept, a prompt served up to its last token): "
        + ", ".join(f"{n} {p:.1f}% of prompt tokens" for n, p in reachable.items())
    )


def build_workload(name: str, scale: dict[str, Any], trace_path: Path | None) -> wl.Workload:
    if name == "chat":
        return wl.chat(**scale["chat"])
    if name in ("trace", "traceburst"):  # other tokens for the burst: the two share no prefix on one engine
        salt = 2 if name == "traceburst" else 0
        return wl.trace(trace_path or wl.default_trace(), **scale[name], salt=salt, name=name)
    if name == "noreuse":
        return wl.noreuse(**scale["noreuse"])
    if name == "saturate":
        return wl.saturate(trace_path or wl.default_trace(), **scale["saturate"])
    raise SystemExit(f"unknown workload {name}")


def token_sources(records: list[RequestRecord], m: dict[str, float]) -> dict[str, int]:
    """Where the workload's prompt tokens came from (see docs/benchmarks.md, "How the numbers are made")."""
    external = int(m.get("external", 0))
    l2 = min(int(m.get("ext_disk", 0)), external)
    other = min(int(m.get("ext_unspecified", 0)), external - l2)
    return {
        "prompt": sum(r.prompt_tokens for r in records),
        "prefix_cache": int(m.get("local_hit", 0)),
        "kvserver_l1": external - l2 - other,
        "kvserver_l2": l2,
        "other_external": other,
        "recomputed": int(m.get("computed", 0)),
        "cached_per_request": sum(r.cached_tokens for r in records),
    }


def routing(records: list[RequestRecord], lookup_s: list[float]) -> dict[str, Any]:
    """How the router picked (coordinator vs round-robin fallbacks), and how often a session's turn
    landed on the engine that served its previous turn (where its history is cached)."""
    last = {(r.session, r.turn): r.engine for r in records}
    later = [r for r in records if r.turn > 0]
    return {
        "via": {v: sum(1 for r in records if r.via == v) for v in sorted({r.via for r in records})},
        "later_turns": len(later),
        "later_turns_same_engine": sum(1 for r in later if last.get((r.session, r.turn - 1)) == r.engine),
        "kv_routed_same_engine": all(
            last.get((r.session, r.turn - 1), r.engine) == r.engine for r in later if r.via == "kv"
        ),
        "lookup_ms_p50": 1000 * pct(lookup_s, 50),
        "lookup_ms_p99": 1000 * pct(lookup_s, 99),
    }


def summarise(records: list[RequestRecord], wall: float, m: dict[str, float]) -> dict[str, Any]:
    ttft = [r.ttft_s for r in records]
    itl = [x for r in records for x in r.itl_s]
    src = token_sources(records, m)
    parts = src["prefix_cache"] + src["kvserver_l1"] + src["kvserver_l2"] + src["other_external"] + src["recomputed"]
    return {
        "requests": len(records),
        "wall_s": wall,
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p90_s": pct(ttft, 90),
        "ttft_p99_s": pct(ttft, 99),
        "itl_p99_s": pct(itl, 99),
        "itl_p50_s": pct(itl, 50),
        "req_per_s": len(records) / wall if wall > 0 else float("nan"),
        "out_tok_per_s": sum(r.output_tokens for r in records) / wall if wall > 0 else float("nan"),
        "sources": src,
        "sources_sum_ok": parts == src["prompt"],
        "cached_matches_metrics": src["cached_per_request"] == src["prompt"] - src["recomputed"],
        "kvserver": {k: m[k] for k in m if k.startswith("kvserver_")},
        "per_engine_requests": [sum(1 for r in records if r.engine == e) for e in sorted({r.engine for r in records})],
        "preemptions": int(m.get("preemptions", 0)),
        "steps": int(m.get("steps", 0)),
        "step_tokens": int(m.get("step_tokens", 0)),
        "reused_pct": 100 * (src["prompt"] - src["recomputed"]) / max(1, src["prompt"]),
        "per_request": {
            "columns": list(PER_REQUEST),
            "rows": [[getattr(r, c) for c in PER_REQUEST] for r in sorted(records, key=lambda r: r.sent_s)],
        },
    }


# Each request of a workload, for reading what a percentile is made of (which requests are slow, and
# whether they hit): kept in the JSON for every round.
PER_REQUEST = ("session", "turn", "engine", "prompt_tokens", "cached_tokens", "sent_s", "ttft_s", "e2e_s")


def settled(urls: list[str], poll_s: float = 0.2, timeout_s: float = 5.0) -> dict[str, float]:
    """The engines' counters once they stop moving: the same in two scrapes `poll_s` apart.

    Why: vLLM publishes a step's stats after it streams the step's tokens, and background saves end
    (and are counted) after their request; a fixed pause long enough for both cost the quick mode
    a tenth of its time.
    """
    last = scrape(urls)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(poll_s)
        now = scrape(urls)
        if now == last:
            return now
        last = now
    return last


def warm_up(urls: list[str]) -> None:
    """One short request per engine (first-call costs stay out of the measurement); unique tokens."""
    rng = random.Random(99)
    w = wl.Workload(
        "warmup", [wl.Session(0.0, [wl.Turn(wl.tokens(128, rng), 4, extend=False)]) for _ in urls], concurrency=1
    )
    asyncio.run(run_workload(RoundRobin(urls), w, lambda: None))


async def _routed(
    make: Callable[[], RoundRobin], w: wl.Workload, tick: Callable[[], None]
) -> tuple[list[RequestRecord], float, list[float]]:
    """One workload through a fresh router (made inside the event loop, which its HTTP session needs)."""
    router = make()
    try:
        records, wall = await run_workload(router, w, tick)
    finally:
        await router.close()
    return records, wall, router.lookup_s if isinstance(router, KvRouter) else []


def router_factory(router: str, dep: eng.Deployment, decode_tokens: int) -> Callable[[], RoundRobin]:
    urls = [e.url for e in dep.engines]
    if router == "rr":
        return lambda: RoundRobin(urls)
    if dep.coordinator is None:
        raise ValueError("the kv router needs --topology per-engine and a KVServerConnector configuration")
    coord, model = dep.coordinator, dep.coordinator.key_model(len(dep.kvservers))
    kvservers = [k.url for k in dep.kvservers]
    if router == "kvscore":
        return lambda: KvScoreRouter(urls, coord.url, kvservers, model, decode_tokens=decode_tokens, token=coord.token)
    return lambda: KvRouter(urls, coord.url, kvservers, model, token=coord.token)


def run_config(
    config: str,
    router: str,
    model: Path,
    workloads: dict[str, wl.Workload],
    args: argparse.Namespace,
    work: Path,
    progress: Progress,
    bar: Any,
) -> dict[str, Any]:
    label = config if router == "rr" else f"{config}+{router}"
    progress.update(bar, description=f"[{label}] starting {args.engines} engines")
    plan = args.kv_plan
    dep = eng.start(
        config,
        model,
        args.engines,
        plan["max_model_len"],
        work / label,
        kvserver_gb=args.kvserver_gb,
        topology=args.topology,
        kv_blocks=plan["blocks"],
        chunk_size=args.chunk_size,
    )
    out: dict[str, Any] = {"startup_s": dep.started_s, "router": router, "workloads": {}}
    try:
        urls = [e.url for e in dep.engines]
        out["engine_kv_blocks"] = [kv_cache_blocks(u) for u in urls]
        if plan["blocks"] is not None and out["engine_kv_blocks"] != [plan["blocks"]] * len(urls):
            raise RuntimeError(f"engines report {out['engine_kv_blocks']} KV blocks, not {plan['blocks']}")
        warm_up(urls)
        make = router_factory(router, dep, args.kv_decode_tokens)
        for name, w in workloads.items():
            progress.update(bar, description=f"[{label}] {name}")
            before, cpu0 = settled(urls), dep.cpu_seconds()
            records, wall, lookup_s = asyncio.run(_routed(make, w, lambda: progress.advance(bar)))
            cpu = {k: v - cpu0[k] for k, v in dep.cpu_seconds().items()}  # before the idle polling
            out["workloads"][name] = summarise(records, wall, delta(settled(urls), before))
            out["workloads"][name]["cpu_s"] = cpu
            out["workloads"][name]["engine_cpu_s"] = cpu["engines"]
            out["workloads"][name]["cpu_ms_per_req"] = 1000 * sum(cpu.values()) / max(1, len(records))
            out["workloads"][name]["routing"] = routing(records, lookup_s)
            out["workloads"][name]["loadavg_1m"] = os.getloadavg()[0]  # other load on the host skews timings
        if config == "example":
            out["example_disk_bytes"] = eng.disk_bytes(dep.workdir / "example-store")
    except Exception as exc:  # one broken configuration must not lose the others' results
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["engine_logs"] = [e.log_tail(12000) for e in dep.engines]  # vLLM's stack trace is "above"
        progress.console.log(f"[{label}] FAILED: {out['error'][:300]}")
    finally:
        dep.stop()
        eng.clean(work / label)
    return out


def _ratio(x: float, base: float | None) -> str:
    return f"{x / base:.2f}x" if base else "-"


def report(results: dict[str, Any], console: Console) -> None:
    configs = [c for c, r in results["configs"].items() if "error" not in r]
    for c, r in results["configs"].items():
        if "error" in r:
            console.print(f"{c}: FAILED: {r['error'][:500]}")
    for name in results["workloads"]:
        base = results["configs"].get("none", {}).get("workloads", {}).get(name) if "none" in configs else None
        console.print(f"\n### {name} ({results['workload_sizes'][name]} requests)\n")
        console.print(
            "| configuration | TTFT p50 s | p90 s | p99 s | ITL p99 ms | req/s | req/s vs none "
            "| TTFT p50 vs none | CPU ms/req (kvserver's) | CPU vs none | engine CPU s | preemptions "
            "| host load (1 min) |"
        )
        console.print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for c in configs:
            r = results["configs"][c]["workloads"][name]
            cpu = r.get("cpu_ms_per_req", 0.0)
            mine = 1000 * r.get("cpu_s", {}).get("kvserver", 0.0) / max(1, r["requests"])
            console.print(
                f"| {c} | {r['ttft_p50_s']:.3f} | {r['ttft_p90_s']:.3f} | {r['ttft_p99_s']:.3f} | "
                f"{1000 * r['itl_p99_s']:.1f} | {r['req_per_s']:.3f} | "
                f"{_ratio(r['req_per_s'], base and base['req_per_s'])} | "
                f"{_ratio(r['ttft_p50_s'], base and base['ttft_p50_s'])} | {cpu:.0f} ({mine:.0f}) | "
                f"{_ratio(cpu, base and base.get('cpu_ms_per_req'))} | {r.get('engine_cpu_s', 0.0):.1f} | "
                f"{r.get('preemptions', 0)} | {r.get('loadavg_1m', 0):.1f} |"
            )
        console.print(
            "\n| configuration | prompt tokens | vLLM prefix cache | kvserver L1 | kvserver L2 "
            "| other connector | recomputed | sums exactly |"
        )
        console.print("|---|---:|---:|---:|---:|---:|---:|---|")
        for c in configs:
            r = results["configs"][c]["workloads"][name]
            s = r["sources"]
            p = max(1, s["prompt"])
            cells = [
                f"{s[k]} ({100 * s[k] / p:.0f}%)"
                for k in ("prefix_cache", "kvserver_l1", "kvserver_l2", "other_external", "recomputed")
            ]
            console.print(
                f"| {c} | {s['prompt']} | " + " | ".join(cells) + f" | {'yes' if r['sources_sum_ok'] else 'NO'} |"
            )
        routed = [c for c in configs if results["configs"][c]["router"] != "rr"]
        if routed:
            console.print(
                "\n| configuration | routed by coordinator | fell back: no hit | fell back: error/timeout "
                "| later turns on their previous engine | lookup p50 ms | p99 ms |"
            )
            console.print("|---|---:|---:|---:|---:|---:|---:|")
        for c in routed:
            g = results["configs"][c]["workloads"][name]["routing"]
            console.print(
                f"| {c} | {g['via'].get('kv', 0)} | {g['via'].get('kv-miss', 0)} | "
                f"{g['via'].get('kv-error', 0)} | {g['later_turns_same_engine']}/{g['later_turns']} | "
                f"{g['lookup_ms_p50']:.1f} | {g['lookup_ms_p99']:.1f} |"
            )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="smaller workloads, none and kvserver")
    mode.add_argument("--smoke", action="store_true", help="KVServerConnector on a tiny chat (the test's mode)")
    ap.add_argument("--configs", default=None, help=f"comma list of {','.join(eng.CONFIGS)}")
    ap.add_argument("--workloads", default=None, help="comma list of chat,trace,traceburst,noreuse,saturate")
    ap.add_argument("--engines", type=int, default=None, help="engines behind the router (default: 3; smoke 2)")
    ap.add_argument(
        "--kv-share",
        type=float,
        default=None,
        help=f"each engine's KV cache as a share of the run's working set (default {KV_SHARE}, never below "
        "the longest request; 0: uncapped, the setup before 2026-12-06)",
    )
    ap.add_argument(
        "--routers",
        default="rr",
        help="comma list of rr (round robin), kv (the coordinator's best "
        "instance), kvscore (its hint weighed against load; kv and kvscore need --topology "
        "per-engine); each runs every configuration on fresh engines",
    )
    ap.add_argument(
        "--kv-decode-tokens",
        type=int,
        default=32,
        help="kvscore: a decoding request on an engine delays a new prefill there by this many tokens",
    )
    ap.add_argument(
        "--topology",
        choices=eng.TOPOLOGIES,
        default="shared",
        help="KVServerConnector configurations: one kvserver for all engines, or one per engine "
        "registered with a coordinator",
    )
    ap.add_argument("--kvserver-gb", type=float, default=1.0, help="kvserver L1 size")
    ap.add_argument(
        "--chunk-size",
        type=int,
        default=None,
        help="tokens per cached object for kvserver and LMCache alike (a multiple of the engines' "
        f"{eng.BLOCK_SIZE}-token block; default: one block, smoke {eng.CHUNK_SIZE})",
    )
    ap.add_argument("--trace", type=Path, default=None, help="Mooncake-format trace (default: the shared one)")
    ap.add_argument("--model-dir", type=Path, default=None, help="reuse/build the bench model here")
    ap.add_argument("--json", type=Path, default=None, help="also write all results here")
    ap.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="run every configuration this many times, in alternating rounds on fresh engines (default 3; "
        "smoke 1); the report adds every figure's median and range, its ratio to none and a verdict "
        "(the first tables show round 1)",
    )
    args = ap.parse_args()
    scale_name = "smoke" if args.smoke else "quick" if args.quick else "full"
    scale = SCALES[scale_name]
    for key in ("engines", "repeats", "kv_share", "chunk_size"):
        if getattr(args, key) is None:
            setattr(args, key, scale[key])
    configs = (args.configs or scale["configs"]).split(",")
    unknown = set(configs) - set(eng.CONFIGS)
    if unknown:
        ap.error(f"unknown configs {sorted(unknown)}")
    if args.chunk_size <= 0 or args.chunk_size % eng.BLOCK_SIZE:
        ap.error(f"--chunk-size must be a positive multiple of the engines' block size {eng.BLOCK_SIZE}")
    if "lmcache" in configs and not eng.LMCACHE_PYTHON.exists():
        if args.configs:
            ap.error(f"lmcache needs {eng.LMCACHE_PYTHON}: build it with scripts/make-lmcache-env.sh")
        configs.remove("lmcache")
        print(
            f"bench.serving: the lmcache anchor is left out: no {eng.LMCACHE_PYTHON} (scripts/make-lmcache-env.sh)",
            file=sys.stderr,
        )
    routers = args.routers.split(",")
    if set(routers) - set(ROUTERS):
        ap.error(f"unknown routers {sorted(set(routers) - set(ROUTERS))}")
    if set(routers) & {"kv", "kvscore"} and (
        args.topology != "per-engine" or any(eng.CONFIGS[c][0] != "KVServerConnector" for c in configs)
    ):
        ap.error("--routers kv/kvscore need --topology per-engine and only KVServerConnector configurations")
    runs = [(c, r) for c in configs for r in routers]
    labels = [c if r == "rr" else f"{c}+{r}" for c, r in runs]
    names = (args.workloads or scale["workloads"]).split(",")
    workloads = {n: build_workload(n, scale, args.trace) for n in names}
    args.kv_plan = plan_kv_cache(workloads, args.kv_share)
    grain = min(args.chunk_size, eng.BLOCK_SIZE)  # the finer of the cache's chunk and the engine's block
    reachable = {n: wl.reachable_reuse(w, grain) for n, w in workloads.items()}
    fingerprints = {n: wl.fingerprint(w) for n, w in workloads.items()}
    console = Console(stderr=True)
    out = Console(width=250, soft_wrap=True, highlight=False)
    t_all = time.perf_counter()
    results: dict[str, Any] = {
        "mode": scale_name,
        "engines": args.engines,
        "model": MODEL,
        "configs": {},
        "topology": args.topology,
        "routers": routers,
        "workloads": names,
        "workload_sizes": {n: w.n_requests for n, w in workloads.items()},
        "scale": {n: scale[n] for n in names},
        "repeats": args.repeats,
        "kv_cache": args.kv_plan,
        "chunk_size": args.chunk_size,
        "engine_block_size": eng.BLOCK_SIZE,
        "fingerprints": fingerprints,
        "reachable_reuse_pct": reachable,
    }
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp_s:
        tmp = Path(tmp_s)
        # one VLLM_CACHE_ROOT for every engine of the run: vLLM inspects the model class once, not
        # once per configuration (a subprocess that imports vLLM: 20-30 s of a configuration's start)
        os.environ.setdefault(SHARED_CACHE_ENV, str(tmp / "vllm-cache"))
        model = build_model(args.model_dir or tmp / "model", MODEL)
        total = args.repeats * len(runs) * sum(w.n_requests for w in workloads.values())
        console.log(describe_plan(args.kv_plan, args.engines) + f"; cache chunk {args.chunk_size} tokens")
        same_requests = True
        with Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
        ) as progress:
            bar = progress.add_task("starting", total=total)
            rounds: list[dict[str, Any]] = []
            requests: list[dict[str, Any]] = []  # round -> configuration -> workload -> per_request
            for rnd in range(args.repeats):
                rounds.append({})
                requests.append({})
                order = list(zip(runs, labels, strict=True))
                for (c, router), label in order[::-1] if rnd % 2 else order:  # A B, B A, ...: no order bias
                    fresh = {n: build_workload(n, scale, args.trace) for n in names}  # sessions are consumed
                    # the same requests in every round and configuration (fixed seeds): checked, not assumed
                    same_requests &= {n: wl.fingerprint(w) for n, w in fresh.items()} == fingerprints
                    w = run_config(c, router, model, fresh, args, tmp, progress, bar)
                    results["configs"].setdefault(label, w)
                    rounds[-1][label] = serving_repeats.compact(w)
                    requests[-1][label] = {n: r["per_request"] for n, r in w.get("workloads", {}).items()}
                    if "error" in w:  # kept with the engines' logs: a run's temporary directory is not
                        failure = {"round": rnd, "config": label, "error": w["error"], "engine_logs": w["engine_logs"]}
                        results.setdefault("failures", []).append(failure)
                        continue
                    console.log(
                        f"{label}: engines up in {w['startup_s']:.0f}s; "
                        + ", ".join(
                            f"{n} {r['req_per_s']:.2f} req/s TTFT p50 {r['ttft_p50_s']:.3f}s"
                            for n, r in w["workloads"].items()
                        )
                    )
            results["rounds"] = rounds
            results["per_request"] = requests
    results["total_s"] = time.perf_counter() - t_all
    results["same_requests"] = same_requests
    results["verdicts"] = serving_repeats.verdicts(rounds, labels, names)
    out.print(
        f"\nbench_serving --{scale_name}: {args.engines} engines, routers {args.routers}, "
        f"topology {args.topology}, {args.repeats} round(s), model {MODEL}, "
        f"total {results['total_s']:.0f}s"
    )
    out.print(describe_plan(args.kv_plan, args.engines) + f"; cache chunk {results['chunk_size']} tokens")
    out.print(describe_reachable(reachable, grain))
    out.print(
        "same requests in every round and configuration: "
        + ("yes" if same_requests else "NO")
        + " ("
        + ", ".join(f"{n} {f}" for n, f in fingerprints.items())
        + ")"
    )
    report(results, out)
    for f in results.get("failures", []):  # the engines' logs are in the JSON
        out.print(f"round {f['round'] + 1}, {f['config']}: FAILED: {f['error'][:300]}")
    if args.repeats > 1:
        serving_repeats.report(results["rounds"], labels, names, out)
    ok = [c for c in labels if "error" not in results["configs"][c]]
    if "none" in ok and "noreuse" in names:
        for c in ok:
            r = serving_repeats.ratios(results["rounds"], c, "noreuse", "req_per_s")
            out.print(
                f"no-reuse throughput {c} / none: {serving_repeats.span(r, '.3f')}"
                + (f" (median of {len(r)} rounds)" if len(r) > 1 else "")
            )
    if "none" in ok:
        for n in names:
            if n in wl.REUSE_WORKLOADS:
                serving_repeats.report_recomputed(
                    results["rounds"], [c for c in ok if c != "none"], n, reachable[n], out
                )
            if n in wl.REUSE_WORKLOADS and workloads[n].concurrency is None:  # open loop: TTFT is latency
                best = ttft_floor(results, n, workloads[n], grain)
                results.setdefault("ttft_at_best", {})[n] = best
                if best:
                    p50, p90 = (
                        serving_repeats.span([x for r in best if (x := r[f"best_p{p}_vs_none"]) is not None], ".3f")
                        for p in (50, 90)
                    )
                    out.print(
                        f"TTFT at best / none's, {n} (each of none's requests shortened by the share of its "
                        f"prompt a cache could serve; an estimate): p50 {p50}, p90 {p90}"
                    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    bad = [(c, n) for c in labels for n, r in results["configs"][c]["workloads"].items() if not r["sources_sum_ok"]]
    bad += [(c, "error") for c in labels if "error" in results["configs"][c]]
    if not same_requests:
        bad.append(("all", "the rounds' requests differ"))
    if bad:
        out.print(f"failed checks (token sources that do not sum, errors, differing requests): {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

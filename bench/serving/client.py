"""Drives a workload against vLLM's OpenAI servers through a router (bench/serving/router.py), and reads
vLLM's /metrics.

Every request is a streaming `/v1/completions` call with token ids as the prompt; TTFT is the time
from sending it to the engine (after the router's pick, whose lookup time is reported apart) to the
first streamed chunk that carries a token, ITL the gaps between later token chunks (a chunk of k
tokens counts as k gaps of 1/k of its wait), and `usage.prompt_tokens_details.cached_tokens` (vLLM's
per-request `num_cached_tokens`: prefix cache plus connector) comes with the final usage chunk.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from bench.serving.router import Pick, RoundRobin, Via
from bench.serving.workloads import Session, Workload


@dataclass
class RequestRecord:
    engine: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    sent_s: float  # since the workload began
    ttft_s: float
    e2e_s: float
    itl_s: list[float] = field(default_factory=list)
    via: Via = "rr"  # how the router picked the engine
    session: int = 0
    turn: int = 0


KEEPALIVE_S = 2.0


class RequestFailed(RuntimeError):
    pass


async def _complete(
    http: aiohttp.ClientSession, router: RoundRobin, prompt: list[int], max_tokens: int, t_origin: float
) -> tuple[RequestRecord, list[int]]:
    pick = await router.pick(prompt)
    out: list[int] = []
    try:
        return await _send(http, router, pick, prompt, max_tokens, t_origin, out)
    finally:
        router.finished(pick, prompt + out)


async def _send(
    http: aiohttp.ClientSession,
    router: RoundRobin,
    pick: Pick,
    prompt: list[int],
    max_tokens: int,
    t_origin: float,
    out: list[int],
) -> tuple[RequestRecord, list[int]]:
    """Streams one completion from the picked engine; generated tokens are appended to `out`."""
    engine, url = pick.engine, pick.url
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    t0 = time.perf_counter()
    first: float | None = None
    last = t0
    itl: list[float] = []
    usage: dict[str, object] = {}
    async with http.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RequestFailed(f"engine {engine}: HTTP {resp.status}: {(await resp.text())[:500]}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):
                raise RequestFailed(f"engine {engine}: {json.dumps(chunk['error'])[:1000]}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            new = [t for c in chunk.get("choices", []) for t in (c.get("token_ids") or [])]
            if not new:
                continue
            now = time.perf_counter()
            if first is None:
                first = now
                router.first_token(pick)
            else:
                itl += [(now - last) / len(new)] * len(new)
            last = now
            out += new
    if first is None or not usage:
        raise RequestFailed(f"engine {engine}: stream ended without tokens or usage")
    details = usage.get("prompt_tokens_details") or {}
    assert isinstance(details, dict)
    rec = RequestRecord(
        engine,
        int(usage["prompt_tokens"]),
        int(details.get("cached_tokens") or 0),  # type: ignore[call-overload]
        len(out),
        t0 - t_origin,
        first - t0,
        last - t0,
        itl,
        pick.via,
    )
    return rec, out


async def _session(
    http: aiohttp.ClientSession,
    router: RoundRobin,
    s: Session,
    sid: int,
    t_origin: float,
    records: list[RequestRecord],
    tick: Callable[[], None],
) -> None:
    delay = s.start_s - (time.perf_counter() - t_origin)
    if delay > 0:
        await asyncio.sleep(delay)
    history: list[int] = []
    for k, turn in enumerate(s.turns):
        if turn.think_s:
            await asyncio.sleep(turn.think_s)
        prompt = history + turn.append if turn.extend else list(turn.append)
        rec, out = await _complete(http, router, prompt, turn.max_tokens, t_origin)
        rec.session, rec.turn = sid, k
        records.append(rec)
        history = prompt + out
        tick()


async def run_workload(router: RoundRobin, w: Workload, tick: Callable[[], None]) -> tuple[list[RequestRecord], float]:
    """All sessions of `w`; returns the records and the wall time from the first send to the last answer."""
    records: list[RequestRecord] = []
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    # keepalive_timeout: reuse an idle connection only within 2 s of its last answer; vLLM's server
    # (uvicorn) closes idle ones after 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE), and a request sent on one
    # as it closes fails with ServerDisconnectedError (it took down a 3-engine, 24-user chat)
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        t_origin = time.perf_counter()
        if w.concurrency is None:
            await asyncio.gather(
                *(_session(http, router, s, i, t_origin, records, tick) for i, s in enumerate(w.sessions))
            )
        else:
            queue = list(enumerate(w.sessions))

            async def worker() -> None:
                while queue:
                    i, s = queue.pop(0)
                    s.start_s = 0.0
                    await _session(http, router, s, i, t_origin, records, tick)

            await asyncio.gather(*(worker() for _ in range(w.concurrency)))
        wall = max(r.sent_s + r.e2e_s for r in records) - min(r.sent_s for r in records)
    return records, wall


# ---- vLLM's /metrics ----

# (metric, label source or None) -> our name; summed over the engines.
WANTED = {
    ("vllm:prompt_tokens_total", None): "prompt",
    ("vllm:num_preemptions_total", None): "preemptions",  # requests the scheduler evicted to free KV blocks
    ("vllm:prompt_tokens_by_source_total", "local_compute"): "computed",
    ("vllm:prompt_tokens_by_source_total", "local_cache_hit"): "local_hit",
    ("vllm:prompt_tokens_by_source_total", "external_kv_transfer"): "external",
    ("vllm:prompt_tokens_cached_by_source_total", "host"): "ext_host",
    ("vllm:prompt_tokens_cached_by_source_total", "disk"): "ext_disk",
    ("vllm:prompt_tokens_cached_by_source_total", "external_unspecified"): "ext_unspecified",
    ("vllm:kvserver_loaded_tokens_total", None): "kvserver_loaded",
    ("vllm:kvserver_hit_tokens_total", None): "kvserver_hit",
    ("vllm:kvserver_declined_tokens_total", None): "kvserver_declined",
    ("vllm:kvserver_saved_chunks_total", None): "kvserver_saved_chunks",
    ("vllm:kvserver_load_errors_total", None): "kvserver_load_errors",
    ("vllm:kvserver_scheduler_wait_seconds_total", None): "kvserver_scheduler_wait_s",
    ("vllm:kvserver_idle_waits_total", None): "kvserver_idle_waits",
    ("vllm:kvserver_save_seconds_total", None): "kvserver_save_s",
    ("vllm:kvserver_saves_total", None): "kvserver_saves",
    ("vllm:kvserver_lookups_total", None): "kvserver_lookups",
    ("vllm:kvserver_lookups_deferred_total", None): "kvserver_lookups_deferred",
    ("vllm:kvserver_loads_in_step_total", None): "kvserver_loads_in_step",
    ("vllm:kvserver_parked_steps_total", None): "kvserver_parked_steps",
    ("vllm:kvserver_loads_total", None): "kvserver_loads",
    ("vllm:kvserver_empty_steps_total", None): "kvserver_empty_steps",
    ("vllm:kvserver_finished_held_steps_total", None): "kvserver_finished_held_steps",
    ("vllm:kvserver_tails_before_forward_total", None): "kvserver_tails_before_forward",
    # engine steps (one observation per step's output) and the tokens they computed: whether a connector
    # splits the same work into more, smaller steps, each paying vLLM's fixed cost per step
    ("vllm:iteration_tokens_total_count", None): "steps",
    ("vllm:iteration_tokens_total_sum", None): "step_tokens",
}


def parse_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        head, _, value = line.rpartition(" ")
        name, _, labels = head.partition("{")
        source = None
        if 'source="' in labels:
            source = labels.split('source="', 1)[1].split('"', 1)[0]
        key = WANTED.get((name, source))
        if key is not None:
            out[key] = out.get(key, 0.0) + float(value)
    return out


def scrape(urls: list[str]) -> dict[str, float]:
    """The WANTED counters, summed over all engines."""
    total: dict[str, float] = {}
    for url in urls:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            for k, v in parse_metrics(r.read().decode()).items():
                total[k] = total.get(k, 0.0) + v
    return total


def kv_cache_blocks(url: str) -> int | None:
    """The engine's KV cache size in blocks, as it reports it (`vllm:cache_config_info`'s num_gpu_blocks)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("vllm:cache_config_info{") and 'num_gpu_blocks="' in line:
                value = line.split('num_gpu_blocks="', 1)[1].split('"', 1)[0]
                return int(value) if value.isdigit() else None
    return None


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}

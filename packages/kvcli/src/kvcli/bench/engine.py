"""`kvcli bench engine`: the same workloads against an OpenAI-compatible server (e.g. vLLM).

Time to first token is what a KV cache saves (the prefill of a reused prefix), so it is measured
per request from the streamed `/v1/completions` answer, and also per round: in multi-round-qa the
first round has nothing to reuse, later rounds do.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from .stats import Latencies
from .workloads import VOCAB, WorkloadSpec

WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
    "quebec",
    "romeo",
    "sierra",
    "tango",
    "uniform",
    "victor",
    "whiskey",
    "xray",
    "yankee",
    "zulu",
]


class EngineUnreachable(Exception):
    """The engine could not be used at all; str() is the reason."""


@dataclass
class Conversation:
    """One user's prompt history, as text or as token ids."""

    as_tokens: bool
    history: Any

    def extend(self, more: Any) -> None:
        self.history = self.history + more


@dataclass
class EngineBench:
    url: str
    spec: WorkloadSpec
    model: str | None = None
    concurrency: int = 4
    prompt_format: str = "text"  # or "tokens" (token-id prompts, for engines without a tokenizer)
    duration: float = 0.0
    timeout: float = 300.0
    lat: Latencies = field(default_factory=Latencies)
    by_round: dict[int, list[float]] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    output_tokens: int = 0
    prompt_tokens: int = 0
    requests: int = 0

    def _draw(self, rng: np.random.Generator, n: int) -> Any:
        ids = rng.integers(0, VOCAB, size=n)
        if self.prompt_format == "tokens":
            return [int(i) for i in ids]
        return "".join(" " + WORDS[int(i) % len(WORDS)] for i in ids)

    async def run(self, on_request: Any = lambda n: None) -> dict[str, Any]:
        base = self.url.rstrip("/")
        async with httpx.AsyncClient(base_url=base, timeout=self.timeout) as client:
            self.model = self.model or await self._default_model(client)
            rng = np.random.default_rng(self.spec.seed)
            shared = self._draw(rng, self.spec.context_tokens)
            convs = [
                Conversation(
                    self.prompt_format == "tokens",
                    self._draw(rng, self.spec.context_tokens) if self.spec.name != "shared-prefix" else shared,
                )
                for _ in range(self.spec.users)
            ]
            sem = asyncio.Semaphore(self.concurrency)
            started = time.perf_counter()

            async def user(u: int) -> None:
                urng = np.random.default_rng([self.spec.seed, u])
                for r in range(self.spec.rounds):
                    if self.duration and time.perf_counter() - started >= self.duration:
                        return
                    question = self._draw(urng, self.spec.question_tokens)
                    if self.spec.name == "random":
                        prompt = self._draw(urng, self.spec.context_tokens)
                    elif self.spec.name == "shared-prefix":
                        prompt = shared + question
                    else:
                        prompt = convs[u].history + question
                    async with sem:
                        answer = await self._one(client, prompt, r)
                    on_request(self.requests)
                    if self.spec.name == "multi-round-qa":
                        more = self._draw(urng, self.spec.answer_tokens) if convs[u].as_tokens else answer
                        convs[u].history = prompt + more

            await asyncio.gather(*(user(u) for u in range(self.spec.users)))
            elapsed = time.perf_counter() - started
        return self.report(elapsed)

    async def _default_model(self, client: httpx.AsyncClient) -> str:
        try:
            resp = await client.get("/v1/models")
        except httpx.HTTPError as exc:
            from .._source import tcp_probe

            reason = tcp_probe(self.url, 1.0) or f"{type(exc).__name__.replace('Error', ' error').lower()}: {exc}"
            raise EngineUnreachable(f"cannot reach {self.url}: {reason}") from None
        if resp.status_code != 200:
            raise EngineUnreachable(f"GET /v1/models answered HTTP {resp.status_code}")
        data = resp.json().get("data") or []
        if not data:
            raise EngineUnreachable("the engine serves no models")
        return str(data[0]["id"])

    async def _one(self, client: httpx.AsyncClient, prompt: Any, round_: int) -> str:
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max(1, self.spec.answer_tokens),
            "stream": True,
            "temperature": 0.0,
            "stream_options": {"include_usage": True},
        }
        t0 = time.perf_counter()
        first: float | None = None
        pieces: list[str] = []
        chunks, usage = 0, None
        self.requests += 1
        try:
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    self._error(f"HTTP {resp.status_code}")
                    return ""
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if event.get("usage"):
                        usage = event["usage"]
                    for choice in event.get("choices") or []:
                        if first is None:
                            first = time.perf_counter()
                        chunks += 1
                        pieces.append(choice.get("text") or "")
        except (httpx.HTTPError, ValueError) as exc:
            self._error(type(exc).__name__)
            return ""
        end = time.perf_counter()
        if first is None:
            self._error("no tokens streamed")
            return ""
        self.lat.add("ttft", first - t0)
        self.lat.add("e2e", end - t0)
        self.by_round.setdefault(round_, []).append(first - t0)
        self.output_tokens += int(usage["completion_tokens"]) if usage else chunks
        self.prompt_tokens += int(usage["prompt_tokens"]) if usage else (len(prompt) if isinstance(prompt, list) else 0)
        return "".join(pieces)

    def _error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    def report(self, elapsed: float) -> dict[str, Any]:
        ok = len(self.lat.samples.get("ttft", []))
        return {
            "target": self.url,
            "model": self.model,
            "workload": self.spec.name,
            "prompt_format": self.prompt_format,
            "spec": {
                "users": self.spec.users,
                "rounds": self.spec.rounds,
                "context_tokens": self.spec.context_tokens,
                "question_tokens": self.spec.question_tokens,
                "answer_tokens": self.spec.answer_tokens,
                "concurrency": self.concurrency,
                "seed": self.spec.seed,
            },
            "requests": self.requests,
            "completed": ok,
            "errors": dict(self.errors),
            "duration_s": round(elapsed, 4),
            "ttft_ms": self.lat.summary(("ttft",))["ttft"],
            "latency_ms": self.lat.summary(("e2e",))["e2e"],
            "ttft_p50_by_round_ms": {
                str(r): round(float(np.percentile(v, 50)) * 1000, 3) for r, v in sorted(self.by_round.items())
            },
            "throughput": {
                "requests_per_s": round(ok / elapsed, 4) if elapsed else None,
                "output_tokens_per_s": round(self.output_tokens / elapsed, 2) if elapsed else None,
                "prompt_tokens_per_s": round(self.prompt_tokens / elapsed, 2) if elapsed else None,
            },
            "output_tokens": self.output_tokens,
            "prompt_tokens": self.prompt_tokens,
        }

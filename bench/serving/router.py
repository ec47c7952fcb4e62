"""The routers of bench/serving/run.py: plain round robin, and KV-aware routing through the coordinator.

Round robin sends request k to engine k mod N whatever its prompt, like a Kubernetes Service. The
KV-aware router asks the coordinator (`POST /v1/fleet/lookup`, tokens packed) which kvserver holds
the longest prefix of the prompt and sends the request to the engine attached to that kvserver (the
per-engine topology: one kvserver per engine, each registered with the coordinator and publishing
KV events); on no hit, an error or a slow answer it falls back to round robin. Every pick says how
it was made, so the benchmark counts how many requests the coordinator routed. The `kvscore` router
asks the same question but weighs the answer against each engine's load and its own memory of what it
sent where (bench/serving/scorer.py), as a production router would.
"""

from __future__ import annotations

import base64
import itertools
import time
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

import aiohttp

from kvprotocol import pack_tokens
from bench.serving.scorer import Scorer

Via = Literal["rr", "kv", "kv-miss", "kv-error"]  # how a pick was made; on the last two kv falls back to round robin
ROUTERS = ("rr", "kv", "kvscore")
LOOKUP_GROUPS = ["0" * 16]  # the index answers by model and chunk hash only (docs/fleet.md, "Namespaces")


@dataclass
class Pick:
    engine: int
    url: str
    via: Via
    ticket: int = 0  # the kvscore router's handle on the request in flight


class RoundRobin:
    """Round robin over the engines' base URLs."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self._next = itertools.cycle(range(len(urls)))

    async def pick(self, prompt: list[int], via: Via = "rr") -> Pick:
        i = next(self._next)
        return Pick(i, self.urls[i], via)

    def first_token(self, pick: Pick) -> None:
        """The request sent by `pick` produced its first token (its prefill is done)."""

    def finished(self, pick: Pick, tokens: list[int]) -> None:
        """The request sent by `pick` ended with prompt + answer `tokens` (round robin forgets it)."""

    async def close(self) -> None:
        """Release what the router holds (nothing for round robin)."""


class KvRouter(RoundRobin):
    """Sends a request to the engine whose kvserver holds the longest prefix; else round robin.

    `kvserver_urls[i]` is engine i's kvserver; `model` the connector's cache-key model
    (`<served name>@<fingerprint>`), the same for every engine of a deployment.
    """

    def __init__(
        self,
        urls: list[str],
        coordinator_url: str,
        kvserver_urls: list[str],
        model: str,
        timeout_s: float = 0.05,
        token: str | None = None,
    ) -> None:
        super().__init__(urls)
        self.coordinator_url = coordinator_url
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}  # the coordinator's token
        self.model = model
        self.timeout_s = timeout_s
        self.lookup_s: list[float] = []
        # a kvserver advertises its bind host (maybe this host's FQDN): on one host the port identifies it
        self._by_port = {urlsplit(u).port: i for i, u in enumerate(kvserver_urls)}
        self._http: aiohttp.ClientSession | None = None

    async def lookup(self, prompt: list[int]) -> dict[str, object] | None:
        """The coordinator's answer for `prompt`, or None on an error or no answer in time."""
        body = {
            "model": self.model,
            "world_size": 1,
            "groups": LOOKUP_GROUPS,
            "tokens": base64.b64encode(pack_tokens(prompt)).decode(),
        }
        if self._http is None:
            self._http = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s), headers=self.headers
            )
        t0 = time.perf_counter()
        try:
            async with self._http.post(self.coordinator_url + "/v1/fleet/lookup", json=body) as resp:
                if resp.status != 200:
                    return None
                answer: dict[str, object] = await resp.json()
                return answer
        except (aiohttp.ClientError, TimeoutError):
            return None
        finally:
            self.lookup_s.append(time.perf_counter() - t0)

    def engine_of(self, instance: object) -> int | None:
        """The engine attached to the kvserver an answer's instance entry names."""
        url = instance.get("zmq_url") if isinstance(instance, dict) else None
        return self._by_port.get(urlsplit(url).port) if isinstance(url, str) else None

    async def pick(self, prompt: list[int], via: Via = "rr") -> Pick:
        answer = await self.lookup(prompt)
        if answer is None:
            return await super().pick(prompt, "kv-error")
        engine = self.engine_of(answer.get("best"))
        if engine is None:
            return await super().pick(prompt, "kv-miss")
        return Pick(engine, self.urls[engine], "kv")

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()


class KvScoreRouter(KvRouter):
    """The coordinator's hint for every engine, weighed against load and the router's own memory.

    Each engine's cost is the prompt tokens it would compute (the prompt minus the larger of its
    kvserver's depth in the index and the longest prefix this router already sent it) plus the
    prefill work queued there; the cheapest wins (serving_scorer.Scorer). `kv-error`: the coordinator
    did not answer, the pick used the router's memory and the load alone; `kv-miss`: no engine had a
    hit, the least loaded was taken.
    """

    def __init__(
        self,
        urls: list[str],
        coordinator_url: str,
        kvserver_urls: list[str],
        model: str,
        timeout_s: float = 0.05,
        decode_tokens: int = 32,
        token: str | None = None,
    ) -> None:
        super().__init__(urls, coordinator_url, kvserver_urls, model, timeout_s, token)
        self.scorer = Scorer(len(urls), decode_tokens=decode_tokens)

    async def pick(self, prompt: list[int], via: Via = "rr") -> Pick:
        answer = await self.lookup(prompt)
        hint: dict[int, int] = {}
        listed = answer.get("instances") if answer is not None else None
        for inst in listed if isinstance(listed, list) else []:
            e = self.engine_of(inst)
            if e is not None:
                hint[e] = max(hint.get(e, 0), int(inst.get("prefix_tokens") or 0))
        choice = self.scorer.choose(prompt, hint)
        ticket = self.scorer.started(choice, prompt)
        how: Via = "kv-error" if answer is None else "kv" if choice.scored else "kv-miss"
        return Pick(choice.engine, self.urls[choice.engine], how, ticket)

    def first_token(self, pick: Pick) -> None:
        self.scorer.prefilled(pick.ticket)

    def finished(self, pick: Pick, tokens: list[int]) -> None:
        self.scorer.finished(pick.ticket, tokens)

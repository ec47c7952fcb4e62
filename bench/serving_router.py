"""The routers of bench_serving.py: plain round robin, and KV-aware routing through the coordinator.

Round robin sends request k to engine k mod N whatever its prompt, like a Kubernetes Service. The
KV-aware router asks the coordinator (`POST /v1/fleet/lookup`, tokens packed) which kvserver holds
the longest prefix of the prompt and sends the request to the engine attached to that kvserver (the
per-engine topology: one kvserver per engine, each registered with the coordinator and publishing
KV events); on no hit, an error or a slow answer it falls back to round robin. Every pick says how
it was made, so the benchmark counts how many requests the coordinator routed.
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

Via = Literal["rr", "kv", "kv-miss", "kv-error"]  # how a pick was made: the last two fell back to round robin
ROUTERS = ("rr", "kv")
LOOKUP_GROUPS = ["0" * 16]  # the index answers by model and chunk hash only (docs/fleet.md, "Namespaces")


@dataclass
class Pick:
    engine: int
    url: str
    via: Via


class RoundRobin:
    """Round robin over the engines' base URLs."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self._next = itertools.cycle(range(len(urls)))

    async def pick(self, prompt: list[int], via: Via = "rr") -> Pick:
        i = next(self._next)
        return Pick(i, self.urls[i], via)

    async def close(self) -> None:
        """Release what the router holds (nothing for round robin)."""


class KvRouter(RoundRobin):
    """Sends a request to the engine whose kvserver holds the longest prefix; else round robin.

    `kvserver_urls[i]` is engine i's kvserver; `model` the connector's cache-key model
    (`<served name>@<fingerprint>`), the same for every engine of a deployment.
    """

    def __init__(self, urls: list[str], coordinator_url: str, kvserver_urls: list[str], model: str,
                 timeout_s: float = 0.05) -> None:
        super().__init__(urls)
        self.coordinator_url = coordinator_url
        self.model = model
        self.timeout_s = timeout_s
        self.lookup_s: list[float] = []
        # a kvserver advertises its bind host (maybe this host's FQDN): on one host the port identifies it
        self._by_port = {urlsplit(u).port: i for i, u in enumerate(kvserver_urls)}
        self._http: aiohttp.ClientSession | None = None

    async def pick(self, prompt: list[int], via: Via = "rr") -> Pick:
        body = {"model": self.model, "world_size": 1, "groups": LOOKUP_GROUPS,
                "tokens": base64.b64encode(pack_tokens(prompt)).decode()}
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        t0 = time.perf_counter()
        try:
            async with self._http.post(self.coordinator_url + "/v1/fleet/lookup", json=body) as resp:
                answer = await resp.json() if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError):
            answer = None
        finally:
            self.lookup_s.append(time.perf_counter() - t0)
        if answer is None:
            return await super().pick(prompt, "kv-error")
        best = answer.get("best")
        engine = self._by_port.get(urlsplit(best["zmq_url"]).port) if best else None
        if engine is None:
            return await super().pick(prompt, "kv-miss")
        return Pick(engine, self.urls[engine], "kv")

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()

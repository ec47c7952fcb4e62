"""How the `kvscore` router of bench/serving/run.py weighs cache hits against load (no I/O, no aiohttp).

The coordinator's hint sees only full chunks that a kvserver stored; it cannot tell apart users whose
prompts share a long system prompt until their own tokens fill a chunk, and following it alone piles
every request with a shared prefix onto one engine. A production router (llm-d's scorers, SGLang's
cache-aware router) therefore combines three things, and so does this one:

- the coordinator's per-instance prefix depth (what each engine's kvserver holds);
- its own approximate view of each engine's prefix cache: the prompts (and answers) it sent there,
  at `block_tokens` granularity, bounded per engine (what vLLM's own prefix cache likely holds,
  which keeps a session on its engine even on a tie in the index);
- the engine's load, in the same unit: the prompt tokens still to be prefilled by the requests sent
  there that have not produced their first token, plus `decode_tokens` for each one decoding.

An engine's cost for a prompt is the tokens it would have to compute (prompt minus expected hit) plus
the prefill work queued ahead of it; the cheapest engine wins, ties go to the engine with fewer
requests in flight, then round robin. Both terms are prefill tokens, so no weight needs tuning to
the model's speed; only a decoding request's share (`decode_tokens`) is a guess.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


def block_keys(tokens: Sequence[int], block_tokens: int) -> list[int]:
    """One key per full block, chained like a prefix cache's block hashes (a key names its whole prefix)."""
    keys, h = [], 0
    for i in range(0, len(tokens) - block_tokens + 1, block_tokens):
        h = hash((h, tuple(tokens[i : i + block_tokens])))
        keys.append(h)
    return keys


class PrefixMemory:
    """The block keys sent to one engine, least recently used first, at most `capacity` of them."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[int, None] = OrderedDict()

    def matched_blocks(self, keys: Sequence[int]) -> int:
        n = 0
        for k in keys:
            if k not in self._keys:
                break
            n += 1
        return n

    def add(self, keys: Sequence[int]) -> None:
        for k in keys:
            self._keys[k] = None
            self._keys.move_to_end(k)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def __len__(self) -> int:
        return len(self._keys)


@dataclass(frozen=True)
class Choice:
    engine: int
    expected_hit_tokens: int  # the larger of the index's depth and the router's own memory
    scored: bool  # False: no engine had a hit, so the least loaded was taken


@dataclass
class _InFlight:
    engine: int
    prefill_tokens: int  # still to compute before its first token; 0 once it decodes


class Scorer:
    """Picks an engine for a prompt from the index's hint, the router's memory and the load."""

    def __init__(
        self, engines: int, block_tokens: int = 32, decode_tokens: int = 32, memory_blocks: int = 65536
    ) -> None:
        if engines < 1 or block_tokens < 1 or decode_tokens < 0:
            raise ValueError("engines and block_tokens must be >= 1, decode_tokens >= 0")
        self.block_tokens, self.decode_tokens = block_tokens, decode_tokens
        self.memory = [PrefixMemory(memory_blocks) for _ in range(engines)]
        self._requests: dict[int, _InFlight] = {}
        self._ticket = 0
        self._turn = 0

    def in_flight(self, engine: int) -> int:
        return sum(1 for r in self._requests.values() if r.engine == engine)

    def queued_tokens(self, engine: int) -> int:
        """Prefill work ahead of a new request on `engine`, in prompt tokens."""
        return sum(r.prefill_tokens or self.decode_tokens for r in self._requests.values() if r.engine == engine)

    def choose(self, prompt: Sequence[int], index_hint: Mapping[int, int] | None = None) -> Choice:
        """`index_hint`: engine -> prefix tokens its kvserver holds (the coordinator's answer), if any."""
        hint = index_hint or {}
        n = len(self.memory)
        start, self._turn = self._turn, (self._turn + 1) % n
        keys = block_keys(prompt, self.block_tokens)  # once per prompt, not once per engine
        hits = [
            min(max(self.memory[e].matched_blocks(keys) * self.block_tokens, hint.get(e, 0)), len(prompt))
            for e in range(n)
        ]
        e = min(
            range(n), key=lambda e: (len(prompt) - hits[e] + self.queued_tokens(e), self.in_flight(e), (e - start) % n)
        )
        return Choice(e, hits[e], any(hits))

    def started(self, choice: Choice, prompt: Sequence[int]) -> int:
        """A request was sent as `choice` said; returns its ticket for `prefilled` and `finished`."""
        self._ticket += 1
        self._requests[self._ticket] = _InFlight(choice.engine, max(1, len(prompt) - choice.expected_hit_tokens))
        self.memory[choice.engine].add(block_keys(prompt, self.block_tokens))
        return self._ticket

    def prefilled(self, ticket: int) -> None:
        """The request's first token arrived: its prefill no longer delays others, its decode does a little."""
        if ticket in self._requests:
            self._requests[ticket].prefill_tokens = 0

    def finished(self, ticket: int, tokens: Sequence[int]) -> None:
        """A request ended; `tokens` (prompt + answer) are now in its engine's prefix cache."""
        r = self._requests.pop(ticket, None)
        if r is not None:
            self.memory[r.engine].add(block_keys(tokens, self.block_tokens))

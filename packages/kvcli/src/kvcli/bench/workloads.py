"""Request streams with known reuse: growing conversations, a shared system prompt, or no reuse.

Each workload yields `Request(user, round, tokens)` in the order a load generator sends them:
round by round, users interleaved, so conversations compete for cache space as they would live.
Token ids are random but seeded, so two runs with one seed send the same requests.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

WORKLOADS = ("multi-round-qa", "shared-prefix", "random")
VOCAB = 32000


@dataclass(frozen=True, slots=True)
class Request:
    user: int
    round: int
    tokens: np.ndarray  # uint32 token ids of the whole prompt


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    name: str
    users: int = 4
    rounds: int = 4
    context_tokens: int = 2048  # first prompt (multi-round), shared prompt (shared-prefix), each prompt (random)
    question_tokens: int = 64  # new user text per round
    answer_tokens: int = 128  # model answer appended to the conversation per round
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(f"unknown workload {self.name!r}; choose from {', '.join(WORKLOADS)}")
        if self.users < 1 or self.rounds < 1 or self.context_tokens < 1:
            raise ValueError("users, rounds and context tokens must be positive")
        if self.question_tokens < 0 or self.answer_tokens < 0:
            raise ValueError("question and answer tokens must be >= 0")

    @property
    def total_requests(self) -> int:
        return self.users * self.rounds

    def max_prompt_tokens(self) -> int:
        if self.name == "multi-round-qa":
            return self.context_tokens + self.rounds * self.question_tokens + (self.rounds - 1) * self.answer_tokens
        if self.name == "shared-prefix":
            return self.context_tokens + self.question_tokens
        return self.context_tokens


def generate(spec: WorkloadSpec) -> Iterator[Request]:
    rng = np.random.default_rng(spec.seed)

    def draw(n: int) -> np.ndarray:
        return rng.integers(0, VOCAB, size=n, dtype=np.uint32)

    if spec.name == "multi-round-qa":
        history = [draw(spec.context_tokens) for _ in range(spec.users)]
        for r in range(spec.rounds):
            for u in range(spec.users):
                prompt = np.concatenate([history[u], draw(spec.question_tokens)])
                yield Request(u, r, prompt)
                history[u] = np.concatenate([prompt, draw(spec.answer_tokens)])
    elif spec.name == "shared-prefix":
        system = draw(spec.context_tokens)
        for r in range(spec.rounds):
            for u in range(spec.users):
                yield Request(u, r, np.concatenate([system, draw(spec.question_tokens)]))
    else:
        for r in range(spec.rounds):
            for u in range(spec.users):
                yield Request(u, r, draw(spec.context_tokens))

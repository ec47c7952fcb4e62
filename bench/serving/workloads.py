"""The three workloads of bench/serving/run.py, as sessions of requests (token ids, no tokenizer).

A session is a sequence of turns run one after another by one simulated client: a turn starts at
`start_s` after the workload began (open loop) or, for later turns, `think_s` after the previous turn
ended; a turn's prompt may extend the previous turn's prompt and generated tokens (a chat history).

  chat     N users; every prompt starts with one long shared system prompt; each round appends the
           previous answer and a new user message; think time between rounds.
  trace    a replay of the Mooncake FAST'25 conversation trace (kvcache-ai/Mooncake,
           FAST25-release/traces/conversation_trace.jsonl, Apache-2.0): whole conversations (requests
           sharing hash_ids[1]) are sampled evenly over the trace's hour, every 512-token hash id
           becomes one fixed synthetic block of `block_tokens` tokens, lengths shrink by the same
           factor, arrival times are compressed to the target duration.
  traceburst  the same from the trace's first conversations: their first turns came within 15 s, so
           compressed they arrive as one burst of cold requests (the `trace` before 2026-12-07).
  noreuse  prompts of random tokens, no shared prefix, a fixed concurrency (closed loop): what a
           connector costs when there is nothing to reuse.
  saturate the trace's requests sent as fast as the engines take them (closed loop, a fixed number in
           flight, arrival times ignored): the load point where throughput, not latency, can differ.

`working_set` and `longest_request` size the engines' KV caches before any engine starts (run.py's
`--kv-share`); `fingerprint` names a workload's requests, so the rounds of a run can be checked to
send the same ones.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from bench.serving.scorer import block_keys

VOCAB = 1024
TRACE_NAME = "mooncake_conversation_trace.jsonl"


@dataclass
class Turn:
    append: list[int]  # tokens appended to the session's history (or the whole prompt of a fresh turn)
    max_tokens: int
    think_s: float = 0.0  # wait after the previous turn of the session ended
    extend: bool = True  # prompt = previous prompt + previous answer + append; False: prompt = append


@dataclass
class Session:
    start_s: float
    turns: list[Turn] = field(default_factory=list)


@dataclass
class Workload:
    name: str
    sessions: list[Session]
    concurrency: int | None = None  # closed loop: at most this many sessions at once (None: open loop)

    @property
    def n_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


def tokens(n: int, rng: random.Random) -> list[int]:
    """Ids in [3, VOCAB): never bos/eos, so generation runs its full length."""
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def chat(
    users: int,
    rounds: int,
    system_tokens: int,
    user_tokens: int,
    max_tokens: int,
    think_s: float,
    stagger_s: float,
    seed: int = 1,
) -> Workload:
    rng = random.Random(seed)
    system = tokens(system_tokens, rng)
    sessions = []
    for u in range(users):
        turns = [Turn(system + tokens(user_tokens, rng), max_tokens, extend=False)]
        for _ in range(rounds - 1):
            turns.append(Turn(tokens(user_tokens, rng), max_tokens, think_s=rng.expovariate(1 / think_s)))
        sessions.append(Session(u * stagger_s, turns))
    return Workload("chat", sessions)


def noreuse(requests: int, prompt_tokens: int, max_tokens: int, concurrency: int, seed: int = 2) -> Workload:
    rng = random.Random(seed)
    sessions = [Session(0.0, [Turn(tokens(prompt_tokens, rng), max_tokens, extend=False)]) for _ in range(requests)]
    return Workload("noreuse", sessions, concurrency=concurrency)


def default_trace() -> Path:
    here = Path(__file__).resolve().parents[2]
    for cand in (here.parent / "shared" / "traces" / TRACE_NAME, Path("/work/shared/traces") / TRACE_NAME):
        if cand.exists():
            return cand
    raise SystemExit(f"no trace found; pass --trace (looked for ../shared/traces/{TRACE_NAME})")


def _block(hash_id: int, block_tokens: int, salt: int = 0) -> list[int]:
    """The fixed synthetic tokens of one trace hash id (the same id gives the same tokens everywhere;
    another `salt`, other tokens: workloads that replay the same requests share nothing)."""
    return tokens(block_tokens, random.Random(1_000_003 * hash_id + 17 + 7919 * salt))


def trace(
    path: Path,
    conversations: int,
    block_tokens: int,
    duration_s: float,
    max_prompt: int,
    max_tokens: int,
    salt: int = 0,
    sample: str = "spread",
    name: str = "trace",
) -> Workload:
    """Replay `conversations` multi-turn conversations of the trace (every request is its own session:
    the trace fixes arrival times, not turn order), scaled as the module docstring says.

    sample="spread": every k-th conversation by its first turn, over the whole trace, so that new and
    continuing conversations mix at every moment as they do in the trace (a uniform thinning keeps
    the shape of its arrivals). sample="first": the first ones, whose first turns all come at once."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_conv: dict[int, list[int]] = defaultdict(list)
    for i, r in enumerate(records):
        if len(r["hash_ids"]) > 1:
            by_conv[r["hash_ids"][1]].append(i)
    multi = sorted((ids for ids in by_conv.values() if len(ids) >= 2), key=lambda ids: ids[0])  # by first turn
    if sample == "first":
        chosen = multi[:conversations]
    elif sample == "spread":
        chosen = multi[:: max(1, len(multi) // max(1, conversations))][:conversations]
    else:
        raise ValueError(f"unknown trace sample {sample!r} (first or spread)")
    picked = sorted(i for ids in chosen for i in ids)
    if not picked:
        raise ValueError("no multi-turn conversations in the trace")
    t0 = records[picked[0]]["timestamp"]
    span = max(1, records[picked[-1]]["timestamp"] - t0)
    scale = block_tokens / 512
    sessions = []
    for i in picked:
        r = records[i]
        n = min(max_prompt, max(block_tokens, int(r["input_length"] * scale)))
        ids: list[int] = []
        for h in r["hash_ids"]:
            ids += _block(h, block_tokens, salt)
            if len(ids) >= n:
                break
        ids = ids[:n]
        out = max(1, min(max_tokens, int(r["output_length"] * scale)))
        start = (r["timestamp"] - t0) / span * duration_s
        sessions.append(Session(start, [Turn(ids, out, extend=False)]))
    return Workload(name, sessions)


def saturate(
    path: Path,
    conversations: int,
    block_tokens: int,
    max_prompt: int,
    max_tokens: int,
    concurrency: int,
    sample: str = "first",
) -> Workload:
    """The trace's requests (as `trace` picks and scales them with `sample`, by default the first
    conversations, as `traceburst`; on tokens of their own: the trace replays run on the same engines
    first), closed loop with `concurrency` in flight."""
    w = trace(path, conversations, block_tokens, 1.0, max_prompt, max_tokens, salt=1, sample=sample)
    for s in w.sessions:
        s.start_s = 0.0
    return Workload("saturate", w.sessions, concurrency=concurrency)


def _prompts(w: Workload) -> list[list[int]]:
    """Every request's prompt and output length, answers stood in by distinct placeholder tokens (ids
    >= VOCAB, never real tokens): what the engines will see, up to the generated tokens' values."""
    return [r.prompt + r.answer for r in _requests(w)]  # a request's KV at its end


class _Request(NamedTuple):
    session: int  # the index in `Workload.sessions`, as the client's records name it
    turn: int
    start_s: float  # its session's start
    prompt: list[int]
    answer: list[int]


def _requests(w: Workload) -> list[_Request]:
    """Every request, sessions by start time, turns in order; answers stood in by distinct
    placeholder tokens (ids >= VOCAB, never real tokens)."""
    out: list[_Request] = []
    fill = VOCAB
    for i, s in sorted(enumerate(w.sessions), key=lambda x: x[1].start_s):  # stable: ties keep their order
        history: list[int] = []
        for k, t in enumerate(s.turns):
            prompt = history + t.append if t.extend else list(t.append)
            answer = list(range(fill, fill + t.max_tokens))
            fill += t.max_tokens
            out.append(_Request(i, k, s.start_s, prompt, answer))
            history = prompt + answer
    return out


def reachable_reuse(w: Workload, block_tokens: int) -> float:
    """The most of the workload's prompt tokens any cache could serve, in %: every earlier request's
    full blocks (prompt and answer, named by their whole prefix) stored the moment it ends and never
    evicted, a prompt served up to its last token (the engine computes at least one). Requests in
    order of their session's start, a session's turns in order: the workloads share across sessions
    only what their first turns share (a system prompt, a trace's conversation prefix), so that
    order is the send order wherever it matters. What `reused_pct` is bounded by."""
    reusable, prompt_tokens = reachable_tokens(w, block_tokens)
    return 100 * reusable / max(1, prompt_tokens)


def trace_reachable(path: Path) -> tuple[int, int, int]:
    """(requests, prompt tokens, the most of them a cache could serve) over the whole trace file as
    recorded, unscaled and unsampled: a request's 512-token block is servable when every block before
    it in that request is and some earlier request had it (the trace's hash ids name a block by its
    prefix), the last partial block never. What bounds a replay's recomputed tokens, before our
    sampling of conversations (`trace`) raises the share by leaving out the single-turn requests."""
    seen: set[int] = set()
    requests = prompt = reachable = 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        n, hashes = int(r["input_length"]), r["hash_ids"]
        requests += 1
        prompt += n
        served = 0
        for j, h in enumerate(hashes):
            if 512 * (j + 1) > n or h not in seen:
                break
            served = 512 * (j + 1)
        reachable += served
        seen.update(hashes)
    return requests, prompt, reachable


def reachable_tokens(w: Workload, block_tokens: int, caches: int = 1) -> tuple[int, int]:
    """(the most prompt tokens a cache could serve, all prompt tokens), as `reachable_reuse` counts
    them; with `caches` > 1 the requests go round robin to that many separate caches (request i of
    that order to cache i mod `caches`, as the round-robin router sends them to per-engine caches)."""
    each = reachable_per_request(w, block_tokens, caches)
    return sum(r.reachable for r in each), sum(r.prompt_tokens for r in each)


class Reach(NamedTuple):
    session: int
    turn: int
    start_s: float
    prompt_tokens: int
    reachable: int  # the most of its prompt a cache could serve


def reachable_per_request(w: Workload, block_tokens: int, caches: int = 1) -> list[Reach]:
    """Every request's reachable prompt tokens, in the order `reachable_reuse` takes them."""
    seen: list[set[int]] = [set() for _ in range(caches)]
    out = []
    for i, r in enumerate(_requests(w)):
        mine = seen[i % caches]
        names = block_keys(r.prompt, block_tokens)
        hit = next((k for k, n in enumerate(names) if n not in mine), len(names))
        reachable = min(hit * block_tokens, max(0, len(r.prompt) - 1))
        out.append(Reach(r.session, r.turn, r.start_s, len(r.prompt), reachable))
        mine.update(block_keys(r.prompt + r.answer, block_tokens))
    return out


@dataclass
class Window:
    start_s: float
    requests: int
    prompt_tokens: int
    to_compute: int  # at best: the prompt tokens no cache could serve


def arrivals(w: Workload, block_tokens: int, window_s: float) -> list[Window]:
    """An open-loop workload of one-request sessions (the trace) in windows of its send times: how
    many requests and prompt tokens arrive, and how many of those tokens must be computed whatever
    the cache does. A burst of first turns is work no cache removes."""
    if w.concurrency is not None or any(len(s.turns) != 1 for s in w.sessions):
        raise ValueError(f"{w.name}: arrivals need an open-loop workload of one-request sessions")
    windows: dict[int, Window] = {}
    for r in reachable_per_request(w, block_tokens):
        k = int(r.start_s // window_s)
        win = windows.setdefault(k, Window(k * window_s, 0, 0, 0))
        win.requests += 1
        win.prompt_tokens += r.prompt_tokens
        win.to_compute += r.prompt_tokens - r.reachable
    return [windows[k] for k in sorted(windows)]


def working_set(w: Workload, block_tokens: int) -> int:
    """The workload's unique prompt tokens, as a prefix cache counts them: the distinct full blocks
    (a block is named by its whole prefix, as vLLM hashes them) of all prompts and answers, times
    `block_tokens`. What a prefix cache must hold for every reuse in the workload to hit."""
    seen: set[int] = set()
    for toks in _prompts(w):
        seen.update(block_keys(toks, block_tokens))
    return len(seen) * block_tokens


def longest_request(w: Workload) -> int:
    """The most tokens (prompt + answer) one request of the workload holds at once."""
    return max((len(p) for p in _prompts(w)), default=0)


def fingerprint(w: Workload) -> str:
    """A digest of every request the workload will send: start times, think times, tokens, lengths."""
    h = hashlib.sha256(f"{w.name} {w.concurrency}".encode())
    for s in w.sessions:
        h.update(f"s {s.start_s:.6f}".encode())
        for t in s.turns:
            h.update(f"t {t.max_tokens} {t.think_s:.6f} {t.extend} {len(t.append)}".encode())
            h.update(",".join(map(str, t.append)).encode())
    return h.hexdigest()[:16]


REUSE_WORKLOADS = ("chat", "trace", "traceburst", "saturate")  # noreuse's working set is all of it and reused by nobody


def plan_kv_cache(
    workloads: dict[str, Workload], share: float, block: int, bytes_per_token: int, uncapped_max_len: int
) -> dict[str, Any]:
    """Each engine's KV cache for a run, fixed from the workloads before any engine starts, the same for
    every configuration. The working set is the largest `working_set` of the run's workloads with
    reuse; the cache holds `share` of it in whole blocks, never less than the run's longest request
    (`clamped` says so), plus the null block vLLM's block pool keeps (`blocks` is what to ask vLLM
    for; `cache_tokens` what requests can use). `max_model_len`: the longest request, rounded up to a
    block (vLLM refuses a cache that cannot hold one max-length request). `share` <= 0: uncapped."""
    sets = {n: working_set(w, block) for n, w in workloads.items()}
    reuse = [sets[n] for n in sets if n in REUSE_WORKLOADS] or list(sets.values())
    ws = max(reuse, default=0)
    longest = max((longest_request(w) for w in workloads.values()), default=0)
    plan: dict[str, Any] = {
        "share": share,
        "working_set_tokens": ws,
        "working_sets": sets,
        "longest_request": longest,
        "bytes_per_token": bytes_per_token,
    }
    if share <= 0:
        return {**plan, "blocks": None, "max_model_len": uncapped_max_len, "clamped": False}
    want = -(-int(share * ws) // block)
    floor = max(1, -(-longest // block))
    n = max(want, floor)
    return {
        **plan,
        "blocks": n + 1,
        "cache_tokens": n * block,
        "cache_mib": n * block * bytes_per_token / 2**20,
        "max_model_len": floor * block,
        "clamped": floor > want,
        "shares": {name: n * block / v for name, v in sets.items() if v},
    }

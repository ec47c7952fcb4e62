"""The trace simulation: Belady bounds every policy, and a real server replaying the same trace
gets exactly the simulated hit rate (the simulation runs the server's own L1 code)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from kvtestkit.tracereplay import register_trace, replay_request
from kvserver.l1.eviction import POLICIES
from kvtestkit.tracesim import BLOCK_TOKENS, OBJECT_BYTES, belady, load_trace, plain_lru, simulate, unique_blocks

SHARED = Path(__file__).resolve().parents[3].parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


def synthetic_trace(path: Path, n: int = 240, seed: int = 3) -> Path:
    """Conversations that come back with longer prompts, sharing one system block (id 0)."""
    rng = random.Random(seed)
    convs: list[list[int]] = []
    next_id = 1
    with path.open("w") as fh:
        for t in range(n):
            if convs and rng.random() < 0.45:
                conv = rng.choice(convs)
            else:
                conv = [0]
                convs.append(conv)
            for _ in range(rng.randint(1, 4)):
                conv.append(next_id)
                next_id += 1
            ids = list(conv)
            fh.write(
                json.dumps(
                    {
                        "timestamp": t,
                        "input_length": len(ids) * BLOCK_TOKENS + 100,
                        "output_length": 10,
                        "hash_ids": ids + [next_id],
                    }
                )
                + "\n"
            )
            next_id += 1
    return path


def first_requests(tmp_path: Path, limit: int):
    if SHARED.exists():  # read-only is enough
        return load_trace(SHARED, limit=limit)
    return load_trace(synthetic_trace(tmp_path / "trace.jsonl", n=limit))


@pytest.fixture
def trace(tmp_path: Path):
    return first_requests(tmp_path, 300)


def test_belady_bounds_every_policy(trace):
    unique = unique_blocks(trace)
    for frac in (0.05, 0.2, 1.0):
        cap = max(1, round(unique * frac))
        best = belady(trace, cap)
        for name in POLICIES:
            assert simulate(trace, name, cap) <= best + 1e-9
        assert plain_lru(trace, cap) <= best + 1e-9
    assert belady(trace, unique) == simulate(trace, "lru", unique)  # everything fits: every reuse hits


# lhd replays longer: its estimate is refreshed every 4096+ inserts and accesses, and the replay
# must run on learned densities (and a changed age coarsening) for a while to compare them
@pytest.mark.parametrize(("policy", "requests"), [("lru", 300), ("arc", 300), ("lhd", 1000)])
def test_a_real_server_gets_the_simulated_hit_rate(server_factory, tmp_path, policy, requests):
    trace = first_requests(tmp_path, requests)
    cap = max(8, round(unique_blocks(trace) * 0.1))
    srv = server_factory(
        "--l1-size-gb",
        repr(cap * OBJECT_BYTES / (1 << 30)),
        "--chunk-size",
        str(BLOCK_TOKENS),
        "--eviction-policy",
        policy,
    )
    with srv.client() as c:
        ks = register_trace(c)
        assert c.call("describe").result["l1"]["capacity_bytes"] == cap * OBJECT_BYTES
        hit_tokens = total = 0
        for req in trace:
            total += req.input_tokens
            hit_tokens += replay_request(c, ks, req.blocks) * BLOCK_TOKENS
    assert hit_tokens > 0
    assert hit_tokens / total == pytest.approx(simulate(trace, policy, cap), abs=1e-12)
    if policy == "lhd":  # it ran on learned densities (until its first refresh it ranks like LRU)
        assert simulate(trace, policy, cap) != simulate(trace, "lru", cap)

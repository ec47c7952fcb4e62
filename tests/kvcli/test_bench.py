"""`kvcli bench server` over both data paths against a real server; `bench engine` against a real HTTP server."""

from __future__ import annotations

import pytest

from kvprotocol import Client

from fake_openai import FakeOpenAI
from kvcli_testutil import CLI, assert_one_line_error

C = 256
SHAPE = ("--layers", "2", "--kv-heads", "2", "--head-dim", "32", "--dtype", "float16", "--block-size", "32")
OBJECT_BYTES = 2 * (C // 32) * (2 * 32 * 64 * 2)  # layers * blocks per chunk * block bytes


def expected_hits(workload: str, users: int, rounds: int, ctx: int, q: int, a: int) -> int:
    """Token hits with an L1 large enough for everything (the cache forgets nothing)."""
    if workload == "random":
        return 0
    if workload == "shared-prefix":
        return (users * rounds - 1) * (ctx // C) * C
    total, length = 0, ctx + q
    for _ in range(1, rounds):
        total += (length // C) * C  # the previous round's prompt is a prefix of this one
        length += a + q
    return users * total


@pytest.mark.parametrize("mode", ["tcp", "shm"])
@pytest.mark.parametrize("workload", ["multi-round-qa", "shared-prefix", "random"])
def test_bench_server_hits_and_report(cli: CLI, server, mode: str, workload: str) -> None:
    users, rounds, ctx, q, a = 3, 3, 600, 64, 128
    run = cli(
        "bench",
        "server",
        "--url",
        server.url,
        "--mode",
        mode,
        "--workload",
        workload,
        "--users",
        str(users),
        "--rounds",
        str(rounds),
        "--context-tokens",
        str(ctx),
        "--question-tokens",
        str(q),
        "--answer-tokens",
        str(a),
        *SHAPE,
        "--verify",
        "--no-progress",
        "--json",
    )
    assert run.code == 0, run.err
    r = run.json()
    assert r["mode"] == mode and r["workload"] == workload and r["requests"] == users * rounds
    assert r["kv_shape"]["object_bytes"] == OBJECT_BYTES
    assert r["hit_tokens"] == expected_hits(workload, users, rounds, ctx, q, a)
    assert r["token_hit_rate"] == pytest.approx(r["hit_tokens"] / r["prompt_tokens"], abs=1e-4)
    assert r["verify_errors"] == 0 and r["errors"] == {}
    assert r["bytes"]["retrieved"] == r["hit_tokens"] // C * OBJECT_BYTES
    assert r["bytes"]["stored"] == r["objects"]["stored"] * OBJECT_BYTES > 0
    lat = r["latency_ms"]
    assert lat["lookup"]["count"] == users * rounds
    assert lat["lookup"]["p50"] <= lat["lookup"]["p90"] <= lat["lookup"]["p99"]
    assert (lat["retrieve"]["count"] > 0) == (workload != "random")
    assert r["throughput_gbps"]["store"] > 0
    with Client(server.url) as c:  # the server saw exactly that traffic and released every lease
        d = c.call("describe").result
    assert d["counters"]["lookups"] == users * rounds and d["counters"]["lookup_hit_tokens"] == r["hit_tokens"]
    assert d["l1"]["leased"] == 0 and d["sessions"] == 0


def test_bench_server_runs_do_not_share_objects_unless_salted(cli: CLI, server) -> None:
    args = (
        "bench",
        "server",
        "--url",
        server.url,
        "--workload",
        "random",
        "--users",
        "2",
        "--rounds",
        "1",
        "--context-tokens",
        "512",
        *SHAPE,
        "--no-progress",
        "--json",
    )
    assert cli(*args).json()["hit_tokens"] == 0
    assert cli(*args).json()["hit_tokens"] == 0  # a fresh salt per run
    assert cli(*args, "--salt", "fixed").json()["hit_tokens"] == 0
    assert cli(*args, "--salt", "fixed").json()["hit_tokens"] == 2 * 512  # same seed, same salt: all reused


def test_bench_server_human_report_and_duration(cli: CLI, server) -> None:
    run = cli(
        "bench",
        "server",
        "--url",
        server.url,
        "--users",
        "2",
        "--rounds",
        "2",
        "--context-tokens",
        "512",
        *SHAPE,
        "--no-progress",
    )
    assert run.code == 0, run.err
    for text in ("token hit rate", "throughput", "lookup", "retrieve", "store", "p99 ms"):
        assert text in run.out
    limited = cli(
        "bench",
        "server",
        "--url",
        server.url,
        "--users",
        "100",
        "--rounds",
        "100",
        "--context-tokens",
        "256",
        *SHAPE,
        "--duration",
        "0.3",
        "--no-progress",
        "--json",
    ).json()
    assert 0 < limited["requests"] < 100 * 100


def test_bench_server_failures(cli: CLI, server, refused_port: int) -> None:
    assert_one_line_error(
        cli("bench", "server", "--url", f"tcp://127.0.0.1:{refused_port}", "--no-progress"), "connection refused"
    )
    bigger_than_l1 = cli(
        "bench",
        "server",
        "--url",
        server.url,
        "--layers",
        "64",
        "--kv-heads",
        "64",
        "--head-dim",
        "256",
        "--no-progress",
    )
    assert_one_line_error(bigger_than_l1, "register_engine refused", "NO_SPACE")
    too_large = cli(
        "bench",
        "server",
        "--url",
        server.url,
        "--layers",
        "4096",
        "--kv-heads",
        "64",
        "--head-dim",
        "256",
        "--no-progress",
    )
    assert_one_line_error(too_large, "bad KV shape", "--layers", "is too large")
    odd_block = cli("bench", "server", "--url", server.url, "--block-size", "7", "--no-progress")
    assert_one_line_error(odd_block, "bad KV shape", "--block-size 7 does not divide the server's chunk size")
    with Client(server.url) as c:
        assert c.call("ping").result["protocol"] == 1


def test_bench_engine_multi_round(cli: CLI) -> None:
    with FakeOpenAI() as engine:
        run = cli(
            "bench",
            "engine",
            "--url",
            engine.url,
            "--users",
            "2",
            "--rounds",
            "3",
            "--context-tokens",
            "50",
            "--question-tokens",
            "5",
            "--answer-tokens",
            "4",
            "--no-progress",
            "--json",
        )
        assert run.code == 0, run.err
        r = run.json()
        assert r["model"] == "fake-llm" and r["requests"] == r["completed"] == 6 and r["errors"] == {}
        assert r["output_tokens"] == 6 * 4
        assert set(r["ttft_ms"]) >= {"p50", "p90", "p99"} and r["ttft_ms"]["count"] == 6
        assert r["ttft_ms"]["p50"] <= r["latency_ms"]["p99"]
        assert set(r["ttft_p50_by_round_ms"]) == {"0", "1", "2"}
        assert r["throughput"]["output_tokens_per_s"] > 0
        # each user's next prompt is its previous prompt plus the streamed answer plus a new question
        prompts = engine.prompts
        assert len(prompts) == 6
        for later in prompts:
            earlier = [p for p in prompts if p != later and later.startswith(p)]
            if earlier:
                prev = max(earlier, key=len)
                rest = later[len(prev) :]
                assert rest.startswith(" ans") and len(rest.split()) == 4 + 5
        assert sum(1 for p in prompts if any(o != p and p.startswith(o) for o in prompts)) == 4


def test_bench_engine_shared_prefix_tokens_and_errors(cli: CLI, refused_port: int) -> None:
    with FakeOpenAI(fail_every=3) as engine:
        run = cli(
            "bench",
            "engine",
            "--url",
            engine.url,
            "--workload",
            "shared-prefix",
            "--prompt-format",
            "tokens",
            "--users",
            "3",
            "--rounds",
            "2",
            "--context-tokens",
            "40",
            "--question-tokens",
            "3",
            "--answer-tokens",
            "2",
            "--no-progress",
            "--json",
        )
        assert run.code == 0, run.err
        r = run.json()
        assert r["requests"] == 6 and r["completed"] == 4 and r["errors"] == {"HTTP 500": 2}
        assert all(isinstance(p, list) and len(p) == 43 and p[:40] == engine.prompts[0][:40] for p in engine.prompts)
        human = cli(
            "bench",
            "engine",
            "--url",
            engine.url,
            "--users",
            "1",
            "--rounds",
            "1",
            "--no-progress",
            "--answer-tokens",
            "2",
            "--context-tokens",
            "10",
        )
        assert human.code == 0 and "ttft" in human.out
    assert_one_line_error(
        cli("bench", "engine", "--url", f"http://127.0.0.1:{refused_port}", "--no-progress"), "connection refused"
    )
    refused = cli("bench", "engine", "--url", f"127.0.0.1:{refused_port}", "--model", "m", "--no-progress", "--json")
    assert refused.code == 1 and "Traceback" not in refused.err and "ConnectError" not in refused.err
    assert refused.json() == {
        "ok": False,
        "url": f"http://127.0.0.1:{refused_port}",
        "reason": f"connection refused at 127.0.0.1:{refused_port}",
    }

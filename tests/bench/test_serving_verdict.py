"""The serving benchmark's verdicts over rounds (bench/serving/verdict.py) and the workload
helpers that size the engines' KV caches (bench/serving/workloads.py). Pure logic, no engines."""

from __future__ import annotations

import pytest

import bench.serving.workloads as wl
from bench.serving.verdict import BETTER, NOISE, TOO_FEW, WORSE, Span, judge, overlap, paired_ratios


def test_disjoint_ranges_decide_by_the_figures_direction() -> None:
    base, mine = [1.0, 1.1, 1.2], [1.5, 1.4, 1.6]
    assert judge(mine, base, higher_is_better=True).verdict == BETTER  # e.g. req/s
    assert judge(mine, base, higher_is_better=False).verdict == WORSE  # e.g. TTFT
    assert judge(base, mine, higher_is_better=False).verdict == BETTER


def test_overlapping_ranges_with_ratios_on_both_sides_of_one_are_noise() -> None:
    v = judge([1.0, 1.3, 1.1], [1.1, 1.0, 1.2], higher_is_better=True)
    assert v.verdict == NOISE
    assert v.ratio is not None and v.ratio.lo < 1.0 < v.ratio.hi


def test_paired_ratios_all_above_one_decide_from_five_rounds_even_when_ranges_overlap() -> None:
    # The host's load moves both configurations together from round to round; in every round the
    # configuration beats the baseline of the same round by about 5%.
    base = [1.0, 2.0, 3.0, 4.0, 5.0]
    mine = [1.05, 2.1, 3.15, 4.2, 5.25]
    v = judge(mine, base, higher_is_better=True)
    assert v.mine is not None and v.base is not None and overlap(v.mine, v.base)
    assert v.verdict == BETTER
    assert v.ratio == Span(1.05, pytest.approx(1.05), pytest.approx(1.05))  # type: ignore[arg-type]
    assert judge(mine, base, higher_is_better=False).verdict == WORSE
    # three such rounds are what nothing at all gives one time in four: no verdict
    assert judge(mine[:3], base[:3], higher_is_better=True).verdict == NOISE


def test_a_configuration_that_changes_nothing_gets_a_verdict_as_often_as_documented() -> None:
    import random

    from bench.serving.verdict import false_verdict_rate

    rng = random.Random(7)
    for rounds, documented in ((3, 0.10), (5, 2 / 252 + 2 / 32)):
        assert false_verdict_rate(rounds) == pytest.approx(documented)
        trials = 4000
        wrong = 0
        for _ in range(trials):  # both configurations draw from the same noise, round by round
            base = [rng.lognormvariate(0, 0.2) for _ in range(rounds)]
            mine = [rng.lognormvariate(0, 0.2) for _ in range(rounds)]
            wrong += judge(mine, base, higher_is_better=True).verdict != NOISE
        assert wrong / trials <= documented + 0.02
    assert false_verdict_rate(2) == 0.0  # too few rounds: no verdict at all


def test_medians_and_ranges() -> None:
    v = judge([3.0, 1.0, 2.0], [2.0, 2.0, 4.0], higher_is_better=True)
    assert v.mine == Span(2.0, 1.0, 3.0)
    assert v.base == Span(2.0, 2.0, 4.0)
    assert v.ratio == Span(0.5, 0.5, 1.5)
    assert v.mine.fmt(".1f") == "2.0 [1.0-3.0]"


def test_too_few_rounds_give_no_verdict() -> None:
    assert judge([2.0], [1.0], higher_is_better=True).verdict == TOO_FEW
    assert judge([2.0, 2.1], [1.0, 1.1], higher_is_better=True).verdict == TOO_FEW
    assert judge([2.0, 2.1], [1.0, 1.1], higher_is_better=True, min_rounds=2).verdict == BETTER
    # a configuration that failed in a round leaves fewer rounds to judge
    assert judge([2.0, None, 2.2], [1.0, 1.1, 1.2], higher_is_better=True).verdict == TOO_FEW
    assert judge([], [], higher_is_better=True).verdict == TOO_FEW


def test_equal_values_and_zero_baselines() -> None:
    # no preemptions in either: the same, and no ratio to speak of
    v = judge([0.0, 0.0, 0.0], [0.0, 0.0, 0.0], higher_is_better=False)
    assert v.verdict == NOISE and v.ratio is None
    # preemptions where the baseline had none: worse by the ranges alone
    assert judge([3.0, 5.0, 4.0], [0.0, 0.0, 0.0], higher_is_better=False).verdict == WORSE
    assert paired_ratios([1.0, None, 2.0], [0.0, 1.0, 4.0]) == [0.5]


def test_rounds_must_pair_up() -> None:
    with pytest.raises(ValueError):
        judge([1.0, 2.0, 3.0], [1.0, 2.0], higher_is_better=True)


def test_working_set_counts_shared_blocks_once() -> None:
    # 4 users on one 512-token system prompt, 2 rounds each of 64 user tokens and 32 generated
    w = wl.chat(users=4, rounds=2, system_tokens=512, user_tokens=64, max_tokens=32, think_s=0.1, stagger_s=0.0)
    # each user's last request holds 512 + 64 + 32 + 64 + 32 = 704 tokens: 11 blocks of 64
    assert wl.longest_request(w) == 704
    # the system prompt's 8 blocks once, then 3 blocks per user (704 / 64 = 11, 8 of them shared)
    assert wl.working_set(w, 64) == (8 + 4 * 3) * 64
    # no reuse: every full block is its own
    n = wl.noreuse(requests=3, prompt_tokens=256, max_tokens=16, concurrency=1)
    assert wl.working_set(n, 64) == 3 * (272 // 64) * 64


def test_reachable_reuse_counts_earlier_full_blocks_up_to_the_last_token() -> None:
    a = list(range(3, 131))  # 128 tokens: two blocks of 64
    later = wl.Workload("t", [wl.Session(1.0, [wl.Turn(a + [7] * 64, 1, extend=False)])])
    first = wl.Workload("t", [wl.Session(0.0, [wl.Turn(a, 1, extend=False)])])
    # sent second (by start time, whatever the list order): its first 128 of 192 tokens are reachable
    both = wl.Workload("t", later.sessions + first.sessions)
    assert wl.reachable_reuse(both, 64) == pytest.approx(100 * 128 / (128 + 192))
    # a prompt equal to an earlier one is served up to its last token, which the engine computes
    again = wl.Workload("t", first.sessions + [wl.Session(2.0, [wl.Turn(a, 1, extend=False)])])
    assert wl.reachable_reuse(again, 64) == pytest.approx(100 * 127 / 256)
    # a block differing anywhere before it is another block: a changed first token reaches nothing
    other = wl.Workload("t", first.sessions + [wl.Session(2.0, [wl.Turn([5] + a[1:], 1, extend=False)])])
    assert wl.reachable_reuse(other, 64) == 0


def test_reachable_reuse_of_a_chat_includes_the_previous_answer() -> None:
    # one user: turn 1 is 128 + 64 prompt tokens and a 64-token answer (4 blocks), turn 2 adds 64
    w = wl.chat(users=1, rounds=2, system_tokens=128, user_tokens=64, max_tokens=64, think_s=0.1, stagger_s=0.0)
    assert wl.reachable_reuse(w, 64) == pytest.approx(100 * 256 / (192 + 320))
    # with 128-token blocks turn 2 still reaches the 256 tokens of turn 1's prompt and answer
    assert wl.reachable_reuse(w, 128) == pytest.approx(100 * 256 / (192 + 320))
    assert wl.reachable_reuse(wl.noreuse(requests=4, prompt_tokens=256, max_tokens=8, concurrency=2), 64) == 0


def test_round_robin_over_separate_caches_reaches_only_every_other_turn() -> None:
    # one user, four turns of 128 + 64k prompt tokens and 64-token answers, over two per-engine caches:
    # turns 1 and 2 find nothing, turn 3 finds turn 1's 256 tokens, turn 4 turn 2's 384
    w = wl.chat(users=1, rounds=4, system_tokens=128, user_tokens=64, max_tokens=64, think_s=0.1, stagger_s=0.0)
    prompts = 192 + 320 + 448 + 576
    assert wl.reachable_tokens(w, 64, caches=2) == (256 + 384, prompts)
    # one cache: every turn finds the one before it
    assert wl.reachable_tokens(w, 64) == (256 + 384 + 512, prompts)


def test_the_same_workload_every_round_and_a_different_one_otherwise() -> None:
    def make(seed: int) -> wl.Workload:
        return wl.chat(
            users=3, rounds=3, system_tokens=128, user_tokens=32, max_tokens=8, think_s=1.0, stagger_s=0.5, seed=seed
        )

    assert wl.fingerprint(make(1)) == wl.fingerprint(make(1))
    assert wl.fingerprint(make(1)) != wl.fingerprint(make(2))
    n = wl.noreuse(requests=4, prompt_tokens=64, max_tokens=8, concurrency=2)
    assert wl.fingerprint(n) == wl.fingerprint(wl.noreuse(requests=4, prompt_tokens=64, max_tokens=8, concurrency=2))
    assert wl.fingerprint(n) != wl.fingerprint(wl.noreuse(requests=4, prompt_tokens=64, max_tokens=8, concurrency=3))


def test_kv_cache_plan_takes_a_share_of_the_largest_reuse_working_set() -> None:
    chat = wl.chat(users=24, rounds=4, system_tokens=512, user_tokens=128, max_tokens=16, think_s=1.0, stagger_s=0.5)
    big = wl.noreuse(requests=100, prompt_tokens=512, max_tokens=16, concurrency=4)
    plan = wl.plan_kv_cache({"chat": chat, "noreuse": big}, 0.1, 64, 8192, 4096)
    # noreuse's working set is larger but reused by nobody: the cap follows chat's
    assert plan["working_set_tokens"] == wl.working_set(chat, 64) == 14336
    assert plan["cache_tokens"] == 23 * 64  # ceil(1433.6 / 64) blocks
    assert plan["blocks"] == 24  # plus vLLM's null block
    assert plan["cache_mib"] == 23 * 64 * 8192 / 2**20
    assert not plan["clamped"]
    assert plan["max_model_len"] == 1088 == wl.longest_request(chat)  # 17 blocks
    assert plan["shares"]["chat"] == 1472 / 14336


def test_kv_cache_plan_never_holds_less_than_the_longest_request() -> None:
    chat = wl.chat(users=1, rounds=4, system_tokens=512, user_tokens=64, max_tokens=8, think_s=0.3, stagger_s=0.0)
    plan = wl.plan_kv_cache({"chat": chat}, 0.1, 64, 8192, 4096)
    assert plan["clamped"]
    assert plan["cache_tokens"] == 832 >= wl.longest_request(chat) == 800
    assert plan["max_model_len"] == 832
    uncapped = wl.plan_kv_cache({"chat": chat}, 0.0, 64, 8192, 4096)
    assert uncapped["blocks"] is None and uncapped["max_model_len"] == 4096


def test_a_round_keeps_its_figures_and_the_connectors_counters() -> None:
    from bench.serving.repeats import compact

    result = {
        "workloads": {
            "saturate": {
                "req_per_s": 7.5,
                "requests": 82,  # not a figure: not kept
                "steps": 900,  # kept, never judged
                "kvserver": {"kvserver_loads": 42.0, "kvserver_loads_in_step": 19.0},
            },
            "trace": {"req_per_s": 1.36},  # no connector (none)
        }
    }
    kept = compact(result)
    assert kept["saturate"] == {
        "req_per_s": 7.5,
        "steps": 900.0,
        "kvserver_loads": 42.0,
        "kvserver_loads_in_step": 19.0,
    }
    assert kept["trace"] == {"req_per_s": 1.36}
    assert compact({"error": "engine died"}) == {}


def test_recomputed_is_reported_against_the_floor_none_leaves() -> None:
    from rich.console import Console

    from bench.serving.repeats import report_recomputed

    # none reuses 20% and a configuration 50%, 60%, 55% in three rounds; at most 60% is reachable
    rounds = [{"none": {"trace": {"reused_pct": 20.0}}, "kv": {"trace": {"reused_pct": r}}} for r in (50.0, 60.0, 55.0)]
    out = Console(record=True, width=250)
    report_recomputed(rounds, ["kv"], "trace", 60.0, out)
    text = out.export_text()
    # recomputed 50/80, 40/80, 45/80 of none's; the floor 40/80 in every round
    assert "kv 0.562 [0.500-0.625]" in text
    assert "the floor (reachable reuse 60.0%): 0.500" in text


def test_arrivals_count_what_each_window_must_compute_at_best() -> None:
    a = list(range(3, 131))  # 128 tokens
    w = wl.Workload(
        "t",
        [
            wl.Session(0.5, [wl.Turn(a, 1, extend=False)]),  # a first turn: all of it computed
            wl.Session(1.5, [wl.Turn([9] * 64, 1, extend=False)]),
            wl.Session(6.0, [wl.Turn(a + [7] * 64, 1, extend=False)]),  # 128 of 192 reachable
        ],
    )
    assert wl.arrivals(w, 64, 5.0) == [wl.Window(0.0, 2, 192, 192), wl.Window(5.0, 1, 192, 64)]
    with pytest.raises(ValueError):  # a closed loop has no arrival times
        wl.arrivals(wl.noreuse(requests=2, prompt_tokens=64, max_tokens=1, concurrency=1), 64, 5.0)


def _trace_file(path, conversations: int):  # type: ignore[no-untyped-def]
    """A trace in the Mooncake format: conversation c starts at c s and comes back 0.5 s later (the
    second hash id names the conversation, the first is shared by all)."""
    import json

    rows = []
    for c in range(conversations):
        for turn in range(2):
            ids = [0, 100 + c] + ([200 + c] if turn else [])
            rows.append(
                {
                    "timestamp": 1000 * c + 500 * turn,
                    "input_length": 512 * len(ids),
                    "output_length": 1,
                    "hash_ids": ids,
                }
            )
    rows.sort(key=lambda r: r["timestamp"])
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def test_a_spread_trace_samples_conversations_over_the_whole_trace(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = _trace_file(tmp_path / "t.jsonl", 8)

    def firsts(w: wl.Workload) -> list[float]:  # the arrival times of first turns (two hash ids)
        return sorted(r.start_s for r in wl._requests(w) if len(r.prompt) == 2 * 32)

    first = wl.trace(path, 2, 32, 10.0, 1024, 1, sample="first")
    spread = wl.trace(path, 2, 32, 10.0, 1024, 1, sample="spread")
    assert first.n_requests == spread.n_requests == 4
    # the first two conversations start 1 s apart in a replay that ends 1.5 s after the first: their
    # first turns take two thirds of it; conversations 0 and 4 start 4 s apart in 4.5 s
    assert firsts(first) == pytest.approx([0.0, 10.0 * 1000 / 1500])
    assert firsts(spread) == pytest.approx([0.0, 10.0 * 4000 / 4500])
    # conversation 4's blocks, not conversation 1's
    assert wl._block(104, 32) in [r.prompt[32:64] for r in wl._requests(spread)]
    assert wl._block(101, 32) not in [r.prompt[32:64] for r in wl._requests(spread)]
    with pytest.raises(ValueError):
        wl.trace(path, 2, 32, 10.0, 1024, 1, sample="last")


def test_the_tail_says_which_slow_requests_were_cold_and_pairs_ttft_per_request() -> None:
    from bench.serving.tails import tail

    a = list(range(3, 131))
    sessions = [wl.Session(0.0, [wl.Turn(a, 1, extend=False)])]  # cold
    sessions += [wl.Session(0.1 * i, [wl.Turn([5 + i] * 128, 1, extend=False)]) for i in range(1, 10)]  # cold
    sessions += [wl.Session(5.0, [wl.Turn(a + [7] * 64, 1, extend=False)])]  # 128 of 192 reachable: warm
    w = wl.Workload("trace", sessions)
    cols = ["session", "turn", "engine", "prompt_tokens", "cached_tokens", "sent_s", "ttft_s", "e2e_s"]

    def records(ttft: list[float]) -> dict[str, object]:
        return {"columns": cols, "rows": [[i, 0, 0, 0, 0, 0.0, t, t] for i, t in enumerate(ttft)]}

    none = [1.0] * 10 + [0.8]
    kv = [2.0] + [0.5] * 9 + [0.2]  # session 0 (cold) is the slowest; the warm one 4x faster than none
    run = {"per_request": [{"none": {"trace": records(none)}, "kv": {"trace": records(kv)}}]}
    rows = {r["config"]: r for r in tail(run, "trace", w, 64)}
    # the slowest tenth of 11 requests is 2 requests: both cold
    assert rows["kv"]["slowest"] == 2 and rows["kv"]["slowest_cold"] == 2 and rows["kv"]["cold"] == 10
    assert rows["kv"]["cold_vs_none"] == pytest.approx(0.5) and rows["kv"]["warm_vs_none"] == pytest.approx(0.25)
    assert rows["none"]["warm_ttft_s"] == pytest.approx(0.8) and "warm_vs_none" not in rows["none"]


def test_ttft_at_best_shortens_each_request_by_what_a_cache_could_serve() -> None:
    from bench.serving.tails import ttft_floor

    a = list(range(3, 131))  # 128 tokens
    sessions = [wl.Session(0.0, [wl.Turn(a, 1, extend=False)])]  # cold
    # 128 of 256 reachable (the first turn's blocks): half of each left to compute
    sessions += [wl.Session(1.0 + i, [wl.Turn(a + [9 + i] * 128, 1, extend=False)]) for i in range(3)]
    w = wl.Workload("trace", sessions)
    cols = ["session", "turn", "engine", "prompt_tokens", "cached_tokens", "sent_s", "ttft_s", "e2e_s"]
    none = [4.0, 1.0, 2.0, 3.0]
    run = {
        "per_request": [
            {"none": {"trace": {"columns": cols, "rows": [[i, 0, 0, 0, 0, 0.0, t, t] for i, t in enumerate(none)]}}}
        ]
    }
    (row,) = ttft_floor(run, "trace", w, 64)
    # none: p50 of [1, 2, 3, 4] by nearest rank is 3 (rank round(1.5) = 2), p90 is 4
    assert (row["none_p50_s"], row["none_p90_s"]) == (3.0, 4.0)
    # at best: [4.0 (cold, kept), 0.5, 1.0, 1.5]: p50 1.5, p90 the cold request's 4.0
    assert (row["best_p50_s"], row["best_p90_s"]) == (1.5, 4.0)
    assert row["best_p50_vs_none"] == pytest.approx(0.5) and row["best_p90_vs_none"] == pytest.approx(1.0)
    assert ttft_floor({"per_request": [{"kv": {"trace": {}}}]}, "trace", w, 64) == []  # no none: nothing to scale

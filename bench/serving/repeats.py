"""Repeated rounds of the serving benchmark: every configuration runs once per round, on fresh
engines, rounds in turn and in alternating order (A B, B A, ...), so that slow drifts of a shared
host's load, and whatever the first or the second configuration of a round suffers, hit every
configuration alike. Every figure is reported as its median and range over the rounds, with its
ratio to the no-connector configuration of the same round (median and range) and a verdict
(bench/serving/verdict.py). Why: one run of a 10 s workload on a shared
2-core host moves by more than the few percent a connector costs when nothing is reused."""

from __future__ import annotations

import statistics
from typing import Any

from rich.console import Console

from bench.serving.verdict import MIN_ROUNDS, SIGN_ROUNDS, Span, false_verdict_rate, judge, paired_ratios

# figure -> (what the report calls it, higher is better, format); every round keeps these
FIGURES: dict[str, tuple[str, bool, str]] = {
    "req_per_s": ("req/s", True, ".3f"),
    "out_tok_per_s": ("output tok/s", True, ".1f"),
    "ttft_p50_s": ("TTFT p50 s", False, ".3f"),
    "ttft_p90_s": ("TTFT p90 s", False, ".3f"),
    "ttft_p99_s": ("TTFT p99 s", False, ".3f"),
    "itl_p99_s": ("ITL p99 s", False, ".4f"),
    "engine_cpu_s": ("engine CPU s", False, ".1f"),
    "cpu_ms_per_req": ("CPU ms/req (engines + kvserver)", False, ".0f"),
    "reused_pct": ("prompt tokens not recomputed %", True, ".1f"),
    "preemptions": ("preemptions", False, ".0f"),
}
BASELINE = "none"
KEPT = ("loadavg_1m", "steps", "step_tokens")  # kept per round beside FIGURES, never judged


def compact(config_result: dict[str, Any]) -> dict[str, dict[str, float]]:
    """The figures a round keeps of one configuration's result (a failed configuration keeps none),
    with the engines' steps and the connector's counters (loads, loads in the step, parked steps,
    declined tokens): what a round's figures came from, for reading a round that stands out."""
    if "error" in config_result:
        return {}
    return {
        name: {f: float(w[f]) for f in (*FIGURES, *KEPT) if f in w}
        | {k: float(v) for k, v in (w.get("kvserver") or {}).items()}
        for name, w in config_result["workloads"].items()
    }


def values(rounds: list[dict[str, Any]], label: str, workload: str, figure: str) -> list[float | None]:
    """`figure` of `label` in every round (None where it failed or lacks the figure)."""
    out: list[float | None] = []
    for r in rounds:
        v = r.get(label, {}).get(workload, {}).get(figure)
        out.append(None if v is None else float(v))
    return out


def ratios(rounds: list[dict[str, Any]], label: str, workload: str, figure: str) -> list[float]:
    """`figure` of `label` over none's in the same round, for every round where both ran."""
    return paired_ratios(values(rounds, label, workload, figure), values(rounds, BASELINE, workload, figure))


def span(xs: list[float], fmt: str) -> str:
    s = Span.of(xs)
    return s.fmt(fmt) if s else "-"


def verdicts(rounds: list[dict[str, Any]], labels: list[str], workloads: list[str]) -> dict[str, Any]:
    """workload -> configuration -> figure -> its median/range, ratio to none and verdict (for the JSON)."""
    out: dict[str, Any] = {}
    for name in workloads:
        for label in labels:
            for fig, (_, up, _) in FIGURES.items():
                mine, base = values(rounds, label, name, fig), values(rounds, BASELINE, name, fig)
                if all(v is None for v in mine):
                    continue
                v = judge(mine, base, up) if label != BASELINE else None
                out.setdefault(name, {}).setdefault(label, {})[fig] = {
                    "values": mine,
                    "median": statistics.median([x for x in mine if x is not None]),
                    "ratio_vs_none": v.ratio.__dict__ if v and v.ratio else None,
                    "verdict": v.verdict if v else None,
                }
    return out


def report(rounds: list[dict[str, Any]], labels: list[str], workloads: list[str], out: Console) -> None:
    def say(text: str) -> None:
        out.print(text, markup=False)  # "[min-max]" is not a style

    has_base = any(BASELINE in r for r in rounds)
    false_pct = 100 * false_verdict_rate(len(rounds))
    say(
        f"\n### {len(rounds)} rounds: median [min-max] over the rounds; ratio = configuration / none of the "
        f"same round; verdict: better/worse when the per-round ranges do not overlap or, from {SIGN_ROUNDS} rounds, "
        f"every round's ratio is on the same side of 1, else within noise (fewer than {MIN_ROUNDS} rounds: no "
        f"verdict; a configuration that changes nothing still gets better/worse in up to {false_pct:.0f}% of "
        "its figures)\n"
    )
    for name in workloads:
        say(f"\n#### {name}\n")
        say("| figure | configuration | median [min-max] | vs none: median [min-max] | verdict |")
        say("|---|---|---:|---:|---|")
        for fig, (title, up, fmt) in FIGURES.items():
            base = values(rounds, BASELINE, name, fig)
            for label in labels:
                mine = values(rounds, label, name, fig)
                if all(v is None for v in mine):
                    continue
                m = Span.of([x for x in mine if x is not None])
                if label == BASELINE or not has_base:
                    say(f"| {title} | {label} | {m.fmt(fmt) if m else '-'} | - | - |")
                    continue
                v = judge(mine, base, up)
                ratio = v.ratio.fmt(".3f") if v.ratio else "-"
                say(f"| {title} | {label} | {m.fmt(fmt) if m else '-'} | {ratio} | {v.verdict} |")


def report_recomputed(
    rounds: list[dict[str, Any]], labels: list[str], workload: str, reachable: float, out: Console
) -> None:
    """Recomputed prompt tokens against none's, per configuration, beside the least any cache could
    leave given none's own reuse in the same round: a goal below that floor cannot be met."""
    base = [r.get("none", {}).get(workload, {}).get("reused_pct") for r in rounds]
    floors = [(100 - reachable) / (100 - b) for b in base if b is not None and b < 100]
    if not floors:
        return
    parts = []
    for c in labels:
        mine = [r.get(c, {}).get(workload, {}).get("reused_pct") for r in rounds]
        ratios = [
            (100 - m) / (100 - b)
            for m, b in zip(mine, base, strict=True)
            if m is not None and b is not None and b < 100
        ]
        parts.append(f"{c} {span(ratios, '.3f')}")
    out.print(
        f"recomputed prompt tokens / none's, {workload}: "
        + ", ".join(parts)
        + f"; the floor (reachable reuse {reachable:.1f}%): {span(floors, '.3f')}"
    )

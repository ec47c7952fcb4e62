"""Repeated rounds of the serving benchmark: every configuration runs once per round, on fresh
engines, rounds in turn and in alternating order (A B, B A, ...), so that slow drifts of a shared
host's load, and whatever the first or the second configuration of a round suffers, hit every
configuration alike. Each round's figures are divided by the no-connector configuration's of the same round; the
report gives the median of those ratios and their range. Why: one run of a 10 s workload on a shared
2-core host moves by more than the few percent a connector costs when nothing is reused."""

from __future__ import annotations

import statistics
from typing import Any

from rich.console import Console

FIGURES = ("req_per_s", "ttft_p50_s", "ttft_p90_s", "itl_p99_s", "cpu_ms_per_req")


def compact(config_result: dict[str, Any]) -> dict[str, dict[str, float]]:
    """The figures a round keeps of one configuration's result (a failed configuration keeps none)."""
    if "error" in config_result:
        return {}
    return {
        name: {f: float(w[f]) for f in (*FIGURES, "loadavg_1m") if f in w}
        for name, w in config_result["workloads"].items()
    }


def ratios(rounds: list[dict[str, Any]], label: str, workload: str, figure: str) -> list[float]:
    """`figure` of `label` over none's in the same round, for every round where both ran."""
    out = []
    for r in rounds:
        mine, base = r.get(label, {}).get(workload), r.get("none", {}).get(workload)
        if mine and base and base.get(figure):
            out.append(mine[figure] / base[figure])
    return out


def span(xs: list[float], fmt: str) -> str:
    if not xs:
        return "-"
    return f"{statistics.median(xs):{fmt}} ({min(xs):{fmt}}-{max(xs):{fmt}})"


def report(rounds: list[dict[str, Any]], labels: list[str], workloads: list[str], out: Console) -> None:
    out.print(f"\n### {len(rounds)} rounds: medians (range) of every round\n")
    for name in workloads:
        out.print(f"\n#### {name}\n")
        out.print(
            "| configuration | req/s | req/s vs none | TTFT p50 s | TTFT p50 vs none | TTFT p90 vs none "
            "| ITL p99 vs none | CPU ms/req | CPU vs none | rounds |"
        )
        out.print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for label in labels:
            got = [r[label][name] for r in rounds if name in r.get(label, {})]
            out.print(
                f"| {label} | {span([g['req_per_s'] for g in got], '.3f')} | "
                f"{span(ratios(rounds, label, name, 'req_per_s'), '.3f')} | "
                f"{span([g['ttft_p50_s'] for g in got], '.3f')} | "
                f"{span(ratios(rounds, label, name, 'ttft_p50_s'), '.2f')} | "
                f"{span(ratios(rounds, label, name, 'ttft_p90_s'), '.2f')} | "
                f"{span(ratios(rounds, label, name, 'itl_p99_s'), '.2f')} | "
                f"{span([g.get('cpu_ms_per_req', 0.0) for g in got], '.0f')} | "
                f"{span(ratios(rounds, label, name, 'cpu_ms_per_req'), '.3f')} | {len(got)} |"
            )

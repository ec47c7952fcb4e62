"""What a run's slowest requests were made of: cold requests (at most a tenth of the prompt
reachable by any cache, `workloads.reachable_per_request`) or requests a cache could serve. A TTFT
percentile set by cold requests moves only as far as the cache shortens the queue they wait in."""

from __future__ import annotations

import statistics
from typing import Any

import bench.serving.workloads as wl

COLD = 0.1  # a request with at most this share of its prompt reachable is cold


def tail(run: dict[str, Any], workload: str, w: wl.Workload, grain: int) -> list[dict[str, Any]]:
    """Per round and configuration of a run's JSON: how many of the slowest tenth of `workload`'s
    requests (`w`, built as the run built it) were cold at `grain`-token blocks, and the cold and the
    other requests' median TTFT, each over none's for the same requests."""
    cold = {(r.session, r.turn): r.reachable <= COLD * r.prompt_tokens for r in wl.reachable_per_request(w, grain)}
    rows = []
    for rnd, configs in enumerate(run.get("per_request", [])):
        ttft = {c: _ttfts(t[workload]) for c, t in configs.items() if t.get(workload)}
        base = ttft.get("none")
        for c, mine in ttft.items():
            slow = sorted(mine, key=lambda k: mine[k], reverse=True)[: max(1, -(-len(mine) // 10))]
            row: dict[str, Any] = {"round": rnd + 1, "config": c, "slowest": len(slow)}
            row["slowest_cold"] = sum(1 for k in slow if cold.get(k, False))
            row["cold"] = sum(1 for k in mine if cold.get(k, False))
            for part, want in (("cold", True), ("warm", False)):
                keys = [k for k in mine if cold.get(k, False) is want]
                row[f"{part}_ttft_s"] = statistics.median([mine[k] for k in keys]) if keys else None
                if base is not None and c != "none":
                    paired = [mine[k] / base[k] for k in keys if base.get(k)]
                    row[f"{part}_vs_none"] = statistics.median(paired) if paired else None
            rows.append(row)
    return rows


def pct(xs: list[float], p: float) -> float:
    """The p-th percentile by nearest rank (the serving report's TTFT and ITL percentiles)."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


def ttft_floor(run: dict[str, Any], workload: str, w: wl.Workload, grain: int) -> list[dict[str, Any]]:
    """Per round of a run's JSON: none's TTFT p50 and p90 for `workload`, and what they would be if a
    cache served every request all it could reach and a request's TTFT shrank with the share of its
    prompt left to compute: none's TTFT of each request times (prompt - reachable) / prompt. Cold
    requests keep their TTFT. An estimate, not a bound: it scales a step's fixed cost away (too low),
    and it keeps the queue cold requests waited in, which a cache shortens under load (too high)."""
    left = {(r.session, r.turn): 1 - r.reachable / max(1, r.prompt_tokens) for r in wl.reachable_per_request(w, grain)}
    rows = []
    for rnd, configs in enumerate(run.get("per_request", [])):
        if not configs.get("none", {}).get(workload):
            continue
        base = _ttfts(configs["none"][workload])
        best = [t * left.get(k, 1.0) for k, t in base.items()]
        row: dict[str, Any] = {"round": rnd + 1}
        for p in (50, 90):
            now, low = pct(list(base.values()), p), pct(best, p)
            row[f"none_p{p}_s"], row[f"best_p{p}_s"] = now, low
            row[f"best_p{p}_vs_none"] = low / now if now > 0 else None
        rows.append(row)
    return rows


def _ttfts(per_request: dict[str, Any]) -> dict[tuple[int, int], float]:
    cols = per_request["columns"]
    s, t, f = cols.index("session"), cols.index("turn"), cols.index("ttft_s")
    return {(row[s], row[t]): row[f] for row in per_request["rows"]}


def by_computed(run: dict[str, Any], workload: str, grain: int) -> list[dict[str, Any]]:
    """Per round of a run's JSON: each configuration's median TTFT of `workload`'s requests grouped
    by the prompt tokens they computed (prompt - cached, in buckets of `grain`). `none`'s requests
    that hit its own prefix cache compute as little as a connector's hits: equal TTFTs at equal
    computed tokens say a hit costs its compute and nothing more, so a percentile moves only with
    the tokens left to compute."""
    rows = []
    for rnd, configs in enumerate(run.get("per_request", [])):
        groups: dict[tuple[str, int], list[float]] = {}
        for c, t in configs.items():
            if not t.get(workload):
                continue
            cols = t[workload]["columns"]
            p, k, f = cols.index("prompt_tokens"), cols.index("cached_tokens"), cols.index("ttft_s")
            for r in t[workload]["rows"]:
                groups.setdefault((c, (r[p] - r[k]) // grain), []).append(r[f])
        for (c, b), ttfts in sorted(groups.items(), key=lambda x: (x[0][1], x[0][0])):
            rows.append(
                {
                    "round": rnd + 1,
                    "config": c,
                    "computed_from": b * grain,
                    "computed_to": (b + 1) * grain,
                    "requests": len(ttfts),
                    "ttft_p50_s": statistics.median(ttfts),
                }
            )
    return rows

"""Turn the soak's raw records (op events, fault windows, server samples) into the report: counts per
op and code, wrong bytes, lost durable objects, recovery per fault kind, latency during and between
faults, server RSS and descriptors. Pure functions of their inputs, so they are easy to check."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

import numpy as np


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 2) if values else None


def ops_table(events: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    table: dict[str, dict[str, Any]] = {}
    for op in sorted({e["op"] for e in events}):
        mine = [e for e in events if e["op"] == op]
        codes = Counter(e["code"] for e in mine if not e["ok"])
        table[op] = {"attempted": len(mine), "completed": sum(e["ok"] for e in mine), "failures": dict(codes)}
    return table


def in_fault(t: float, windows: list[tuple[float, float]]) -> bool:
    return any(start <= t <= end for start, end in windows)


def latency(events: list[dict[str, Any]], windows: list[tuple[float, float]]) -> dict[str, dict[str, Any]]:
    split: dict[str, dict[str, list[float]]] = defaultdict(lambda: {"during": [], "between": []})
    for e in events:
        split[e["op"]]["during" if in_fault(e["t"], windows) else "between"].append(e["ms"])
    return {
        op: {phase: {"n": len(v), "p50_ms": _pct(v, 50), "p99_ms": _pct(v, 99)} for phase, v in phases.items()}
        for op, phases in sorted(split.items())
    }


def recovery(events: list[dict[str, Any]], faults: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Seconds from each fault's end to the first verified hit (a load that returned the right bytes)."""
    hits = sorted(e["t"] + e["ms"] / 1000 for e in events if e["op"] == "load" and e["ok"] and e.get("wrong") == 0)
    per: dict[str, list[float | None]] = defaultdict(list)
    for f in faults:
        if f.get("skipped"):
            continue
        after = next((t for t in hits if t >= f["end"]), None)
        per[f["kind"]].append(None if after is None else after - f["end"])
    out: dict[str, dict[str, Any]] = {}
    for kind, values in sorted(per.items()):
        seen = [v for v in values if v is not None]
        out[kind] = {
            "faults": len(values),
            "recovered": len(seen),
            "max_s": round(max(seen), 2) if seen else None,
            "median_s": _pct(seen, 50),
        }
    return out


def resources(samples: list[dict[str, Any]], warmup_s: float) -> dict[str, Any]:
    """RSS and descriptors of the server; growth is judged within one server process (a restart
    starts a new one), from the end of its warm-up to its last sample."""
    by_pid: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for s in samples:
        by_pid[s["pid"]].append(s)
    procs = []
    for pid, rows in by_pid.items():
        start = rows[0]["t"]
        warm = [r for r in rows if r["t"] - start >= warmup_s] or rows[-1:]
        procs.append(
            {
                "pid": pid,
                "seconds": round(rows[-1]["t"] - start, 1),
                "rss_mib_after_warmup": round(warm[0]["rss_kb"] / 1024, 1),
                "rss_mib_last": round(rows[-1]["rss_kb"] / 1024, 1),
                "anon_mib_after_warmup": round(warm[0]["anon_kb"] / 1024, 1),
                "anon_mib_max": round(max(r["anon_kb"] for r in warm) / 1024, 1),
                "anon_mib_last": round(rows[-1]["anon_kb"] / 1024, 1),
                "fds_after_warmup": warm[0]["fds"],
                "fds_max": max(r["fds"] for r in warm),
                "fds_last": rows[-1]["fds"],
            }
        )
    return {"processes": procs}


def server_counters(last: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """What the server dropped or evicted on purpose, summed over its processes (counters restart
    with each one): these are not losses, and are reported apart from them."""
    out: dict[str, Any] = {
        "l1_evictions": 0,
        "write_behind_dropped": 0,
        "skipped_evicted": 0,
        "prefetched": 0,
        "late_write_dropped": 0,
    }
    tiers: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for d in last.values():
        out["l1_evictions"] += d.get("l1", {}).get("evictions", 0)
        out["late_write_dropped"] += d.get("counters", {}).get("late_write_dropped", 0)
        queue = d.get("l2_queue", {})
        out["write_behind_dropped"] += queue.get("dropped", 0)
        out["skipped_evicted"] += queue.get("skipped_evicted", 0)
        out["prefetched"] += queue.get("prefetched_objects", 0)
        for t in d.get("l2", []):
            for k in ("puts", "hits", "errors", "corrupt", "dropped", "retried"):
                tiers[t["tier"]][k] += t.get(k, 0)
    out["tiers"] = {k: dict(v) for k, v in tiers.items()}
    return out


def table(report: dict[str, Any]) -> str:
    """The report as plain text tables (for the terminal and docs/reliability.md)."""
    lines = [
        f"seed {report['seed']}  length {report['seconds']:.0f} s  faults {len(report['faults'])}  "
        f"wrong bytes accepted {report['wrong_blocks']}  durable objects lost {report['durable']['lost']}  "
        f"(durable checked {report['durable']['checked']}, fs mounted {report['durable']['fs_mounted']})",
        "",
        "| op | attempted | completed | failures by code |",
        "|---|---:|---:|---|",
    ]
    for op, row in report["ops"].items():
        codes = ", ".join(f"{k} {v}" for k, v in sorted(row["failures"].items())) or "-"
        lines.append(f"| {op} | {row['attempted']} | {row['completed']} | {codes} |")
    lines += ["", "| op | p50 ms between | p99 ms between | p50 ms during faults | p99 ms during faults |"]
    lines.append("|---|---:|---:|---:|---:|")
    for op, ph in report["latency"].items():
        b, d = ph["between"], ph["during"]
        lines.append(f"| {op} | {b['p50_ms']} | {b['p99_ms']} | {d['p50_ms']} | {d['p99_ms']} |")
    lines += ["", "| fault | count | recovered | median s to first verified hit | max s |", "|---|---:|---:|---:|---:|"]
    for kind, row in report["recovery"].items():
        lines.append(f"| {kind} | {row['faults']} | {row['recovered']} | {row['median_s']} | {row['max_s']} |")
    lines += ["", "| server pid | s | RSS MiB warm/last | anon MiB warm/max/last | fds warm/max/last |"]
    lines.append("|---|---:|---|---|---|")
    for p in report["server"]["processes"]:
        lines.append(
            f"| {p['pid']} | {p['seconds']} | {p['rss_mib_after_warmup']}/{p['rss_mib_last']} | "
            f"{p['anon_mib_after_warmup']}/{p['anon_mib_max']}/{p['anon_mib_last']} | "
            f"{p['fds_after_warmup']}/{p['fds_max']}/{p['fds_last']} |"
        )
    a = report["apart_from_losses"]
    lines += [
        "",
        f"apart from losses: L1 evictions {a['l1_evictions']}, write-behind dropped {a['write_behind_dropped']}, "
        f"skipped (evicted before written) {a['skipped_evicted']}, L2 prefetched {a['prefetched']}, "
        f"objects a late writer overwrote, dropped {a['late_write_dropped']}",
        f"L2 tiers: {a['tiers']}",
    ]
    h = report["hostile"]
    lines += [
        "",
        f"hostile: sent {sum(h['sent'].values())}, replies {h['replies']}",
        f"hostile messages unanswered while the server was up: {h['unanswered_while_up']}",
    ]
    lines.append(f"client processes crashed (not killed by the soak): {report['client_crashes']}")
    return "\n".join(lines)

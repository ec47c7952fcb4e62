"""Human-readable bench reports (rich tables); `--json` prints the report map instead."""

from __future__ import annotations

from typing import Any

from .._output import human_bytes, percent


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _latency_table(title: str, lat: dict[str, dict[str, Any]]) -> Any:
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for col in ("op", "count", "p50 ms", "p90 ms", "p99 ms", "mean ms"):
        table.add_column(col, justify="left" if col == "op" else "right")
    for op, s in lat.items():
        table.add_row(op, str(s["count"]), _ms(s["p50"]), _ms(s["p90"]), _ms(s["p99"]), _ms(s["mean"]))
    return table


def _kv(title: str, rows: list[tuple[str, str]]) -> Any:
    from rich.table import Table

    table = Table(title=title, title_justify="left", show_header=False, box=None, padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    for row in rows:
        table.add_row(*row)
    return table


def _num(v: float | None, digits: int) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def _gbps(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f} GB/s"


def server_report(r: dict[str, Any]) -> list[Any]:
    shape, thr, obj = r["kv_shape"], r["throughput_gbps"], r["objects"]
    summary = _kv(
        f"bench server: {r['workload']} over {r['mode']} against {r['target']}",
        [
            ("requests", f"{r['requests']} in {r['duration_s']:.2f} s"),
            (
                "kv shape",
                f"{shape['layers']} layers x {shape['kv_heads']} kv heads x {shape['head_dim']} head dim, "
                f"{shape['dtype']}, block {shape['block_size']}, chunk {shape['chunk_size']} "
                f"({human_bytes(shape['object_bytes'])}/object)",
            ),
            ("token hit rate", f"{percent(r['token_hit_rate'])} ({r['hit_tokens']} of {r['prompt_tokens']} tokens)"),
            (
                "stored",
                f"{human_bytes(r['bytes']['stored'])} ({obj['stored']} objects, {obj['deduplicated']} deduplicated,"
                f" {obj['no_space']} refused for space)",
            ),
            ("retrieved", f"{human_bytes(r['bytes']['retrieved'])} ({obj['retrieved']} objects)"),
            (
                "throughput",
                f"store {_gbps(thr['store'])}, retrieve {_gbps(thr['retrieve'])}, overall {_gbps(thr['overall'])}",
            ),
            ("verify errors", str(r["verify_errors"])),
            ("errors", ", ".join(f"{k}={v}" for k, v in r["errors"].items()) or "none"),
        ],
    )
    return [summary, _latency_table("latency", r["latency_ms"])]


def engine_report(r: dict[str, Any]) -> list[Any]:
    thr = r["throughput"]
    summary = _kv(
        f"bench engine: {r['workload']} against {r['target']} (model {r['model']})",
        [
            ("requests", f"{r['completed']} of {r['requests']} completed in {r['duration_s']:.2f} s"),
            (
                "throughput",
                f"{_num(thr['requests_per_s'], 2)} req/s, {_num(thr['output_tokens_per_s'], 0)} output tok/s, "
                f"{_num(thr['prompt_tokens_per_s'], 0)} prompt tok/s",
            ),
            ("ttft p50 by round", ", ".join(f"r{k}: {v:.1f} ms" for k, v in r["ttft_p50_by_round_ms"].items()) or "-"),
            ("errors", ", ".join(f"{k}={v}" for k, v in r["errors"].items()) or "none"),
        ],
    )
    return [summary, _latency_table("latency", {"ttft": r["ttft_ms"], "end-to-end": r["latency_ms"]})]

"""`kvcli bench server|engine`: load generators with a progress bar and a latency/throughput report."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click

from .._auth import token_options
from .._output import emit_json, fail, stderr_console, stdout_console
from .._source import DEFAULT_URL, HTTP_URL, URL, Unreachable, fail_fast


def _need_numpy() -> None:
    """bench generates payloads with numpy, an optional dependency of kvcli (the `bench` extra)."""
    try:
        import numpy  # noqa: F401
    except ImportError:
        fail("kvcli bench needs numpy: pip install 'kvcli[bench]'")


WORKLOAD_CHOICES = ("multi-round-qa", "shared-prefix", "random")


def _workload_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    options = [
        click.option("--workload", type=click.Choice(WORKLOAD_CHOICES), default="multi-round-qa", show_default=True),
        click.option("--users", default=4, show_default=True, type=click.IntRange(1, 100000)),
        click.option("--rounds", default=4, show_default=True, type=click.IntRange(1, 100000)),
        click.option(
            "--context-tokens",
            default=2048,
            show_default=True,
            type=click.IntRange(1, 1 << 20),
            help="First prompt (multi-round-qa), shared system prompt (shared-prefix), whole prompt (random).",
        ),
        click.option("--question-tokens", default=64, show_default=True, type=click.IntRange(0, 1 << 20)),
        click.option("--answer-tokens", default=128, show_default=True, type=click.IntRange(0, 1 << 20)),
        click.option(
            "--duration",
            default=0.0,
            show_default=True,
            type=click.FloatRange(0),
            help="Stop after this many seconds (0: when the workload ends).",
        ),
        click.option("--seed", default=0, show_default=True, type=int),
        click.option("--no-progress", is_flag=True, help="No progress bar."),
        click.option("--json", "as_json", is_flag=True, help="Print the report as JSON."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def shape_message(message: str, block_size: int) -> str:
    """A layout refusal in the words of bench's flags, not of LayoutDescriptor's fields."""
    if "multiple of block_size" in message:
        return f"--block-size {block_size} does not divide the server's chunk size"
    if "too large" in message:
        return "one object (--layers x --kv-heads x 2 x --head-dim x --block-size x dtype per chunk) is too large"
    for field, flag in (
        ("block_size", "--block-size"),
        ("num_layers", "--layers"),
        ("dtype", "--dtype"),
        ("block_shape", "--kv-heads/--head-dim"),
        ("chunk_size", "the server's chunk size"),
    ):
        message = message.replace(field, flag)
    return message


@contextmanager
def _progress(total: int, label: str, enabled: bool) -> Iterator[Callable[[int], None]]:
    if not enabled:
        yield lambda n: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=stderr_console(),
        transient=True,
    ) as progress:
        task = progress.add_task(label, total=total)
        yield lambda n: progress.update(task, completed=n)


def _spec(
    workload: str, users: int, rounds: int, context_tokens: int, question_tokens: int, answer_tokens: int, seed: int
) -> Any:
    from ..bench.workloads import WorkloadSpec

    return WorkloadSpec(workload, users, rounds, context_tokens, question_tokens, answer_tokens, seed)


def _print(renderables: list[Any]) -> None:
    console = stdout_console()
    for r in renderables:
        console.print(r)


@click.group(name="bench")
def command() -> None:
    """Load generators against a kvserver or an OpenAI-compatible engine."""


@command.command(name="server")
@click.option("--url", type=URL, default=DEFAULT_URL, show_default=True, help="kvserver ZMQ url (host:port or tcp://).")
@click.option(
    "--mode",
    type=click.Choice(["tcp", "shm"]),
    default="tcp",
    show_default=True,
    help="Data path: bytes in ZMQ frames, or the server's shared-memory arena (same host).",
)
@_workload_options
@click.option("--layers", default=4, show_default=True, type=click.IntRange(1, 4096))
@click.option("--kv-heads", default=4, show_default=True, type=click.IntRange(1, 1024))
@click.option("--head-dim", default=64, show_default=True, type=click.IntRange(1, 4096))
@click.option(
    "--dtype",
    default="float16",
    show_default=True,
    type=click.Choice(["float32", "float16", "bfloat16", "float8_e4m3fn", "int8"]),
)
@click.option("--block-size", default=32, show_default=True, type=click.IntRange(1, 65536))
@click.option("--model", default="bench-model", show_default=True, help="Model name to register as.")
@click.option("--salt", default=None, help="Cache salt (default: a fresh one per run, so runs never share objects).")
@click.option("--verify", is_flag=True, help="Compare every retrieved byte, not only each object's stamp.")
@click.option("--timeout", default=30.0, show_default=True, type=click.FloatRange(0.01, 3600))
@token_options
def server(
    url: str,
    mode: str,
    workload: str,
    users: int,
    rounds: int,
    context_tokens: int,
    question_tokens: int,
    answer_tokens: int,
    duration: float,
    seed: int,
    no_progress: bool,
    as_json: bool,
    layers: int,
    kv_heads: int,
    head_dim: int,
    dtype: str,
    block_size: int,
    model: str,
    salt: str | None,
    verify: bool,
    timeout: float,
) -> None:
    """Drive a running kvserver over its real protocol (lookup, retrieve, store, commit)."""
    from kvprotocol import ValidationError

    _need_numpy()
    from ..bench.kvshape import KVShape
    from ..bench.server import BenchAborted, ServerBench

    spec = _spec(workload, users, rounds, context_tokens, question_tokens, answer_tokens, seed)
    shape = KVShape(layers, kv_heads, head_dim, dtype, block_size)
    bench = ServerBench(
        url, spec, shape, mode=mode, model=model, salt=salt, duration=duration, verify=verify, timeout=timeout
    )
    try:
        fail_fast(url, timeout)
        with _progress(spec.total_requests, f"{workload} ({mode})", not no_progress) as advance:
            report = bench.run(advance)
    except ValidationError as exc:
        fail(f"bad KV shape: {shape_message(exc.message, block_size)}", as_json, url=url)
    except (Unreachable, BenchAborted, OSError, ValueError) as exc:
        fail(str(exc), as_json, url=url)
    if as_json:
        emit_json(report)
    else:
        from ..bench.report import server_report

        _print(server_report(report))
    if report["verify_errors"]:
        fail(f"{report['verify_errors']} retrieved objects did not hold the bytes stored under their key")


@command.command(name="engine")
@click.option(
    "--url", type=HTTP_URL, required=True, help="Base url of an OpenAI-compatible server, e.g. http://127.0.0.1:8000."
)
@click.option("--model", default=None, help="Model to request (default: the first of GET /v1/models).")
@_workload_options
@click.option(
    "--concurrency",
    default=4,
    show_default=True,
    type=click.IntRange(1, 4096),
    help="Requests in flight at once (each user's rounds stay in order).",
)
@click.option(
    "--prompt-format",
    type=click.Choice(["text", "tokens"]),
    default="text",
    show_default=True,
    help="Prompts as text, or as token-id lists (engines started without a tokenizer).",
)
@click.option("--timeout", default=300.0, show_default=True, type=click.FloatRange(0.01, 86400))
def engine(
    url: str,
    model: str | None,
    workload: str,
    users: int,
    rounds: int,
    context_tokens: int,
    question_tokens: int,
    answer_tokens: int,
    duration: float,
    seed: int,
    no_progress: bool,
    as_json: bool,
    concurrency: int,
    prompt_format: str,
    timeout: float,
) -> None:
    """Time to first token and throughput of an OpenAI-compatible engine (/v1/completions, streaming)."""
    import asyncio

    _need_numpy()
    from ..bench.engine import EngineBench, EngineUnreachable

    spec = _spec(workload, users, rounds, context_tokens, question_tokens, answer_tokens, seed)
    bench = EngineBench(
        url, spec, model=model, concurrency=concurrency, prompt_format=prompt_format, duration=duration, timeout=timeout
    )
    try:
        fail_fast(url, min(timeout, 2.0))  # "connection refused at host:port", not a ConnectError per request
        with _progress(spec.total_requests, f"{workload} -> {url}", not no_progress) as advance:
            report = asyncio.run(bench.run(advance))
    except (Unreachable, EngineUnreachable) as exc:
        fail(str(exc), as_json, url=url)
    if as_json:
        emit_json(report)
    else:
        from ..bench.report import engine_report

        _print(engine_report(report))
    if report["completed"] == 0:
        errors = ", ".join(f"{n} x {kind}" for kind, n in sorted(report["errors"].items())) or "none recorded"
        fail(f"no request completed (errors: {errors})")

"""`kvcli top`: the live dashboard (Textual), or one table/JSON sample with --once/--json."""

from __future__ import annotations

from pathlib import Path

import click

from .._auth import token_options
from .._output import emit_json, fail, stdout_console
from .._source import DEFAULT_URL, HTTP_URL, URL, Unreachable


@click.command(name="top")
@click.option(
    "--url",
    "urls",
    multiple=True,
    type=URL,
    help="Instance to watch (repeat for several): tcp:// (ZMQ describe) or http:// (/v1/status). "
    f"Default: {DEFAULT_URL}.",
)
@click.option(
    "--coordinator", type=HTTP_URL, default=None, help="Watch every instance a coordinator knows (http:// url)."
)
@click.option(
    "--interval", default=2.0, show_default=True, type=click.FloatRange(0.1, 3600), help="Seconds between polls."
)
@click.option(
    "--window", default=300.0, show_default=True, type=click.FloatRange(10), help="Seconds of history the charts show."
)
@click.option(
    "--timeout",
    default=1.0,
    show_default=True,
    type=click.FloatRange(0.01, 600),
    help="Seconds to wait for each instance.",
)
@click.option("--sort", type=click.Choice(["id", "hit", "ops", "l1", "errors"]), default="id", show_default=True)
@click.option("--once", is_flag=True, help="Print one sample (two polls an interval apart) and exit.")
@click.option("--json", "as_json", is_flag=True, help="With --once (implied): print the sample as JSON.")
@click.option(
    "--replay",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    hidden=True,
    help="Play back recorded polls (JSON) instead of polling.",
)
@token_options
def command(
    urls: tuple[str, ...],
    coordinator: str | None,
    interval: float,
    window: float,
    timeout: float,
    sort: str,
    once: bool,
    as_json: bool,
    replay: Path | None,
) -> None:
    """Live dashboard of one server or a whole fleet: hit rates, L1/L2, ops/s, evictions, errors."""
    from ..top.sources import CoordinatorSource, DirectSource, ReplaySource, Source

    if coordinator and urls:
        raise click.UsageError("give --url or --coordinator, not both")
    try:
        source: Source
        if replay is not None:
            source = ReplaySource.from_file(replay)
        elif coordinator:
            source = CoordinatorSource(coordinator, timeout=max(timeout, 3.0))
        else:
            source = DirectSource(list(urls) or [DEFAULT_URL], timeout=timeout)
    except Unreachable as exc:
        fail(str(exc), as_json)
    if once or as_json:
        from ..top.once import as_json as sample_json
        from ..top.once import collect, table

        try:
            fleet = collect(source, interval, sort)
        finally:
            source.close()
        if as_json:
            emit_json({"source": source.label, **sample_json(fleet, sort)})
        else:
            sample = table(fleet, sort, f"kvcli top: {source.label}")  # every column: for logs and scripts
            stdout_console(max(150, stdout_console(10_000).measure(sample).maximum)).print(sample)
        if not any(v.up for v in fleet.views.values()):
            fail("no instance is up")
        return
    from ..top.app import TopApp

    app = TopApp(source, interval=interval, window=window)
    app.sort = sort
    app.run()

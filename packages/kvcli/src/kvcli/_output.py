"""Output helpers shared by commands: JSON on stdout, one-line errors on stderr, human units."""

from __future__ import annotations

import json
import sys
from typing import Any, NoReturn

import click


class CLIError(click.ClickException):
    """A failure the operator should read as one line on stderr; exit status 1."""

    exit_code = 1

    def show(self, file: Any = None) -> None:
        click.echo(f"kvcli: {self.format_message()}", err=True)


def fail(reason: str, as_json: bool = False, **fields: Any) -> NoReturn:
    """One `kvcli: reason` line on stderr and exit 1; under --json also `{"ok": false, ..., "reason": reason}`
    on stdout, so a script reading stdout always gets a document."""
    if as_json:
        emit_json({"ok": False, **fields, "reason": reason})
    raise CLIError(reason)


def emit_json(obj: Any) -> None:
    """Machine output: one JSON document on stdout (bytes become hex)."""
    click.echo(json.dumps(obj, indent=2, sort_keys=False, default=_default))


def _default(obj: Any) -> Any:
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return bytes(obj).hex()
    if isinstance(obj, (set, tuple)):
        return list(obj)
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def percent(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def ratio(num: float, den: float) -> float | None:
    """num/den, or None when there is nothing to divide (no lookups yet is not a 0% hit rate)."""
    return num / den if den else None


def stdout_console(min_width: int = 0) -> Any:
    """Rich console on stdout; `min_width` keeps wide tables readable when piped (default 80)."""
    from rich.console import Console

    console = Console(file=sys.stdout, soft_wrap=False)
    if console.width < min_width:
        console = Console(file=sys.stdout, soft_wrap=False, width=min_width)
    return console


def stderr_console() -> Any:
    from rich.console import Console

    return Console(file=sys.stderr)

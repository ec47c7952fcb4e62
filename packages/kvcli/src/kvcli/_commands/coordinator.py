"""`kvcli coordinator`: starts the fleet coordinator when the `kvcoordinator` package is installed.

The coordinator (FastAPI, uvicorn, prometheus-client) lives in its own package so kvcli stays a light
client; without it this command says what to install instead of failing on an import.
"""

from __future__ import annotations

from typing import Any

import click

from .._output import fail

MISSING = (
    "the coordinator is not installed here: install the kvcoordinator package "
    "(pip install 'kvcli[coordinator]' or pip install kvcoordinator)"
)


def _missing_command() -> click.Command:
    @click.command(
        name="coordinator",
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []},
    )
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def missing(args: tuple[str, ...]) -> Any:
        """Run the fleet coordinator (needs the kvcoordinator package)."""
        fail(MISSING)

    return missing


try:
    from kvcoordinator.cli import command as _command
except ImportError as exc:
    if exc.name is None or not exc.name.startswith("kvcoordinator"):
        raise
    command: click.Command = _missing_command()
else:
    command = _command

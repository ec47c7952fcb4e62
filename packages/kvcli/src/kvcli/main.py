"""`kvcli`: the operator CLI. Subcommands load lazily so `kvcli --help` stays fast and torch-free."""

from __future__ import annotations

import importlib
from typing import Any

import click

# name -> (module under kvcli._commands, short help shown without importing it)
COMMANDS: dict[str, tuple[str, str]] = {
    "ping": ("ping", "Round trip and version of a kvserver (and HTTP health)."),
    "describe": ("describe", "Configuration, usage, hit rates, engines and sessions of a kvserver."),
    "query": ("query", "Per-chunk presence of a token sequence and its reusable prefix."),
    "bench": ("bench", "Load generators against a kvserver or an OpenAI-compatible engine."),
    "coordinator": ("coordinator", "Run the fleet coordinator."),
    "top": ("top", "Live dashboard of one server or a whole fleet."),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        module = importlib.import_module(f"kvcli._commands.{COMMANDS[cmd_name][0]}")
        command: click.Command = module.command
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name][1]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvcli")
def main(**_: Any) -> None:
    """Inspect and drive kvserver caches from any host (no torch, no GPU needed)."""

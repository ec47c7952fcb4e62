"""`kvcli`: the operator CLI. Subcommands load lazily so `kvcli --help` stays fast and torch-free."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import Any

import click

from ._auth import reset, token_options

# name -> (module under kvcli._commands, short help shown without importing it)
COMMANDS: dict[str, tuple[str, str]] = {
    "ping": ("ping", "Round trip and version of a kvserver (and HTTP health)."),
    "describe": ("describe", "Configuration, usage, hit rates, engines and sessions of a kvserver."),
    "query": ("query", "Per-chunk presence of a token sequence and its reusable prefix."),
    "bench": ("bench", "Load generators against a kvserver or an OpenAI-compatible engine."),
    "coordinator": ("coordinator", "Run the fleet coordinator (needs the kvcoordinator package)."),
    "top": ("top", "Live dashboard of one server or a whole fleet."),
    "clear": ("admin", "Remove every ready, unleased object (pinned ones too) from a server's L1."),
    "pin": ("admin", "Keep a token sequence's chunks in L1 (eviction never takes them)."),
    "unpin": ("admin", "Release pinned chunks of a token sequence."),
    "instances": ("instances", "Instances registered with a coordinator."),
}


def usage_line(exc: click.UsageError) -> str:
    """A usage error as one line: `kvcli: <command>: <what is wrong> (kvcli <command> --help)`."""
    path = exc.ctx.command_path if exc.ctx is not None else "kvcli"
    where = path.split(" ", 1)[1] + ": " if " " in path else ""
    hint = f" (see {path} --help)" if exc.ctx is not None else ""
    return f"kvcli: {where}{exc.format_message()}{hint}"


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        module = importlib.import_module(f"kvcli._commands.{COMMANDS[cmd_name][0]}")
        command: click.Command = getattr(module, f"{cmd_name}_command", None) or module.command
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name][1]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        """click's main, except that usage errors are one `kvcli: ...` line on stderr (exit 2)."""
        reset()
        try:
            return self._main(args, prog_name, complete_var, standalone_mode, **extra)
        finally:
            source = sys.modules.get("kvcli._source")
            if source is not None:
                source.close_http_clients()

    def _main(
        self,
        args: Sequence[str] | None,
        prog_name: str | None,
        complete_var: str | None,
        standalone_mode: bool,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.UsageError as exc:
            click.echo(usage_line(exc), err=True)
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("kvcli: aborted", err=True)
            sys.exit(1)
        except (EOFError, KeyboardInterrupt):
            click.echo("kvcli: aborted", err=True)
            sys.exit(1)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvcli")
@token_options
def main(**_: Any) -> None:
    """Inspect and drive kvserver caches from any host (no torch, no GPU needed).

    Shell completion: eval "$(_KVCLI_COMPLETE=bash_source kvcli)" (zsh_source, fish_source).
    """

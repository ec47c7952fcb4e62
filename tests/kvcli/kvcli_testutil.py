"""Helpers for kvcli tests (imported by name; fixtures live in conftest.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from click.testing import Result


@dataclass
class Run:
    result: Result

    @property
    def code(self) -> int:
        return self.result.exit_code

    @property
    def out(self) -> str:
        return self.result.stdout

    @property
    def err(self) -> str:
        return self.result.stderr

    def json(self) -> Any:
        return json.loads(self.result.stdout)


CLI = Callable[..., Run]


def assert_one_line_error(run: Run, *needles: str) -> None:
    """Exit 1 and exactly one `kvcli: ...` line on stderr containing every needle."""
    assert run.code == 1, (run.code, run.out, run.err)
    lines = run.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvcli: "), run.err
    for needle in needles:
        assert needle in lines[0], lines[0]


def assert_usage_error(run: Run, *needles: str) -> None:
    """Exit 2 and exactly one `kvcli: <command>: ...` line on stderr containing every needle."""
    assert run.code == 2, (run.code, run.out, run.err)
    lines = run.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvcli: "), run.err
    for needle in needles:
        assert needle in lines[0], lines[0]

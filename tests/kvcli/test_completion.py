"""Shell completion as docs/cli.md documents it: the script, commands and options complete."""

from __future__ import annotations

import os
import subprocess

from kvtestkit.serverproc import BIN


def complete(*words: str) -> list[str]:
    env = {
        **os.environ,
        "_KVCLI_COMPLETE": "bash_complete",
        "COMP_WORDS": " ".join(("kvcli", *words)),
        "COMP_CWORD": str(len(words)),
    }
    out = subprocess.run([str(BIN / "kvcli")], env=env, capture_output=True, text=True, timeout=60).stdout
    return [line.split(",", 1)[1] for line in out.splitlines() if "," in line]


def test_bash_completion() -> None:
    script = subprocess.run(
        [str(BIN / "kvcli")],
        env={**os.environ, "_KVCLI_COMPLETE": "bash_source"},
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert "_kvcli_completion()" in script
    assert set(complete("pi")) == {"pin", "ping"}
    assert {"--token", "--token-file"} <= set(complete("ping", "--to"))
    assert "--yes" in complete("clear", "--y")

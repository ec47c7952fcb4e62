"""kvcli runs on hosts without torch: no command imports torch, kvserver or kvconnector, and
`kvcli --help` imports none of the heavy libraries (its start-up time is measured, not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvcli.main import COMMANDS

HERE = Path(__file__).parent
FORBIDDEN = ("torch", "kvserver", "kvconnector")


def run_python(code: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=HERE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


PROBE = """
import json, sys
def loaded(names):
    return sorted(n for n in sys.modules if n.split(".")[0] in names)
"""


def test_help_is_lazy(record_property: pytest.RecordProperty) -> None:
    out = run_python(
        PROBE
        + """
from kvcli.main import main
try:
    main(["--help"])
except SystemExit:
    pass
print(json.dumps({"heavy": loaded({"textual", "httpx", "numpy", "rich", "zmq", "kvprotocol", "torch",
                                   "kvserver", "kvconnector", "fastapi", "uvicorn"})}))
"""
    )
    assert out["heavy"] == []
    kvcli = str(Path(sys.executable).parent / "kvcli")
    t0 = time.perf_counter()
    proc = subprocess.run([kvcli, "--help"], capture_output=True, text=True, timeout=600)
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 0 and all(name in proc.stdout for name in COMMANDS)
    record_property("kvcli_help_seconds", round(elapsed, 3))
    print(f"kvcli --help took {elapsed:.3f} s")


def test_no_command_imports_torch_or_server_packages(server) -> None:
    """Each command's real code path, in one fresh interpreter, against a real server."""
    out = run_python(
        PROBE
        + f"""
import asyncio
from click.testing import CliRunner
from kvcli.main import main
from fake_openai import FakeOpenAI
url = {server.url!r}
codes = {{}}
def cli(*args):
    r = CliRunner().invoke(main, list(args), catch_exceptions=False)
    codes[" ".join(args[:2])] = r.exit_code
cli("ping", "--url", url)
cli("describe", "--url", url, "--json")
cli("bench", "server", "--url", url, "--users", "1", "--rounds", "2", "--context-tokens", "512", "--no-progress",
    "--layers", "1", "--kv-heads", "1", "--head-dim", "16", "--json")
cli("query", "--url", url, "--model", "bench-model", "--tokens", ",".join(["7"] * 300))
with FakeOpenAI() as engine:
    cli("bench", "engine", "--url", engine.url, "--users", "1", "--rounds", "1", "--context-tokens", "8",
        "--answer-tokens", "2", "--no-progress")
cli("top", "--url", url, "--once", "--interval", "0.1")
cli("pin", "--url", url, "--model", "bench-model", "--tokens", ",".join(["7"] * 300))
cli("unpin", "--url", url, "--model", "bench-model", "--tokens", ",".join(["7"] * 300))
cli("clear", "--url", url, "--yes")
for name in ("ping", "describe", "query", "bench", "top", "clear", "pin", "unpin", "instances"):
    cli(name, "--help")
from kvcli.top.app import TopApp
from kvcli.top.sources import DirectSource
async def dashboard():
    app = TopApp(DirectSource([url]), interval=0.2)
    async with app.run_test() as pilot:
        while app.fleet.polls < 2:
            await pilot.pause(0.05)
        await pilot.press("d")
        await pilot.press("escape")
        await pilot.press("q")
asyncio.run(dashboard())
print(json.dumps({{"codes": codes, "forbidden": loaded({set(FORBIDDEN)!r})}}))
"""
    )
    assert out["forbidden"] == []
    assert set(out["codes"].values()) == {0}, json.dumps(out["codes"])
    assert {
        "ping --url",
        "describe --url",
        "query --url",
        "bench server",
        "bench engine",
        "top --url",
        "pin --url",
        "unpin --url",
        "clear --url",
    } <= set(out["codes"])

"""`kvserver start` names the flag an operator typed when a value is refused, not the internal field."""

from __future__ import annotations

import subprocess

import pytest

from kvtestkit.serverproc import BIN, free_port


@pytest.mark.parametrize(
    "args,flag",
    [
        (("--l1-size-gb", "0"), "--l1-size-gb must be in (0, 4096]"),
        (("--lease-ttl", "0"), "--lease-ttl must be in (0, 3600]"),
        (("--heartbeat-interval", "0"), "--heartbeat-interval must be in (0, 3600]"),
    ],
)
def test_refused_values_name_the_flag(args: tuple[str, ...], flag: str) -> None:
    done = subprocess.run(
        [str(BIN / "kvserver"), "start", "--port", str(free_port()), "--http-port", "0", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == f"kvserver: {flag}" + (" seconds" if "ttl" in flag or "interval" in flag else "")
    assert "_" not in done.stderr.split(":", 1)[1].split(" must")[0]


def test_an_l2_capacity_without_eviction_admission_is_refused() -> None:
    done = subprocess.run(
        [str(BIN / "kvserver"), "start", "--port", str(free_port()), "--http-port", "0", "--l2-capacity-gb", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.strip().startswith("kvserver: --l2-capacity-gb needs --l2-admission 'evicted'")

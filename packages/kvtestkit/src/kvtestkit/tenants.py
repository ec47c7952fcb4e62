"""Tenants made the way an operator makes them: the real `kvserver tenant add` CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def add_tenant(tenants: Path, name: str, *flags: str) -> str:
    """Add (or re-key) tenant `name` in the tenants file; returns its token (printed once by the CLI)."""
    kvserver = Path(sys.executable).parent / "kvserver"
    cmd = [str(kvserver), "tenant", "add", name, "--tenants-file", str(tenants), *flags]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()

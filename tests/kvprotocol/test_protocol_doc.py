"""docs/protocol.md holds the op tables generated from the typed definitions (no drift)."""

from __future__ import annotations

import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_protocol_doc_tables_match_the_structs():
    tables = runpy.run_path(str(ROOT / "scripts" / "protocol_tables.py"))["tables"]()
    assert tables in (ROOT / "docs" / "protocol.md").read_text(), (
        "regenerate with: uv run python scripts/protocol_tables.py (and paste into docs/protocol.md)"
    )

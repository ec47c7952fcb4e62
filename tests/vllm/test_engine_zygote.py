"""The engine zygote (tests/vllm/engine_zygote.py) keeps what a fresh interpreter per engine gave:
an engine past its timeout dies with its whole process group, and the next engine forked from the
same parent builds its own state and computes what a fresh engine computes."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from vllm_cases import MAX_TOKENS, P_LONG
from kvtestkit.engines.vllm_harness import EngineRun, engine_zygote_pids, prompt, run_engine

pytestmark = pytest.mark.vllm_engine


def _children(pid: int) -> set[int]:
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        out |= {int(c) for c in (task / "children").read_text().split()}
    return out


def test_an_engine_past_its_timeout_is_killed_and_the_next_one_is_a_fresh_engine(
    model_dir: Path, reference: EngineRun
) -> None:
    run_engine(model_dir, [[prompt(P_LONG[:64])]], max_tokens=1)  # the zygote is up (the session may have started it)
    zygotes = engine_zygote_pids()
    assert zygotes and all(_children(z) == set() for z in zygotes)
    with pytest.raises(subprocess.TimeoutExpired):
        run_engine(model_dir, [[prompt(P_LONG)]], max_tokens=MAX_TOKENS, timeout=0.5)
    deadline = time.monotonic() + 10
    while any(_children(z) for z in zygotes) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_children(z) == set() for z in zygotes)  # killed and reaped, not left beside the next test
    again = run_engine(
        model_dir, [[prompt(P_LONG)]], max_tokens=MAX_TOKENS, llm_kwargs={"enable_prefix_caching": False}
    )
    assert engine_zygote_pids() == zygotes  # the same parent served it: no new one started
    assert again.requests[0].token_ids == reference.requests[0].token_ids

"""bench/gpu_check.py is ready for the day a GPU is lent: its --dry-run runs every step (round trips
through a real kvserver for every layout, bandwidth rounds, the register timing, copies under matrix
products, the prefix load) on CPU tensors through the same functions the GPU run uses, and without
CUDA the GPU run stops at once with one line. Correctness and structure only, never timings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from bench import gpu_check
from kvtestkit.backend_layouts import CASES as BACKENDS

BENCH = Path(__file__).resolve().parents[2] / "bench"

SECTIONS = ("roundtrip", "bandwidth", "register", "overlap", "prefix")


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCH / "gpu_check.py"), *args],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, **(env or {})},
    )


def test_dry_run_round_trips_every_layout_and_reports_every_section(tmp_path: Path) -> None:
    proc = _run("--dry-run", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["verdict"] == "pass" and report["mode"] == "dry-run"
    assert all(s in report and "error" not in report[s] for s in SECTIONS)
    supported = {c.name for c in gpu_check.CASES if c.supported}
    rt = report["roundtrip"]
    legacy = [r for r in rt if not r["layout"].startswith("vllm:")]
    assert {(r["layout"], r["dtype"]) for r in legacy} == {
        (c.name, d) for c in gpu_check.CASES for d in ("bfloat16", "float16")
    }
    assert all(r["status"] == ("ok" if r["layout"] in supported else "not supported yet") for r in legacy)
    assert all(r["bytes"] > 0 for r in legacy if r["status"] == "ok")
    # every vLLM 0.32 backend layout the reader names, as vLLM allocates it, through the torch copier
    backends = {r["layout"]: r for r in rt if r["layout"].startswith("vllm:")}
    assert set(backends) == {f"vllm:{n}" for n in BACKENDS}
    assert all(r["status"] == "ok" and r["equal"] and r["untouched"] for r in backends.values()), backends
    rows = report["bandwidth"]["rows"]
    assert {(r["layout"], r["block_size"]) for r in rows} == {(n, b) for n in supported for b in (16, 64)}
    assert all(
        r["bitwise_equal"] and {"load_ratio", "save_ratio", "load_gbps", "raw_h2d_gbps"} <= r.keys() for r in rows
    )
    assert report["bandwidth"]["worst"]["layout"] in supported
    assert report["overlap"]["copies_bitwise_equal"] and report["overlap"]["products_unchanged"]
    assert report["overlap"]["copy_rounds"] >= 3
    assert report["prefix"]["bitwise_equal"] and report["prefix"]["tokens"] == gpu_check.Sizes.dry().prefix_tokens
    text = (tmp_path / "gpu_check.txt").read_text()
    assert "| vllm:flashinfer/HND/bf16 | auto | ok |" in text and "verdict: pass" in text


def test_without_cuda_the_gpu_run_stops_at_once_with_one_line(tmp_path: Path) -> None:
    proc = _run("--out", str(tmp_path), env={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and "CUDA is not available" in proc.stderr
    assert not (tmp_path / "gpu_check.json").exists()  # nothing built, no server started


def _rig(case: gpu_check.Case) -> gpu_check.Rig:
    m = gpu_check.Model(2, 2, 8, 16, 16, 64, torch.bfloat16)
    kv = gpu_check.allocate(case, m, 8, torch.device("cpu"), random=True)
    rig = gpu_check.Rig(case, m, None, None, None, kv, kv, 4, [7, 5, 6, 4], False)
    axis = case.block_axis
    for t in kv:  # make the destination blocks exact copies of the sources
        t.index_copy_(axis, torch.tensor(rig.dst_ids), t.index_select(axis, torch.arange(4)))
    return rig


def test_the_comparison_sees_one_flipped_byte_in_any_loaded_block() -> None:
    for case in [c for c in gpu_check.CASES if c.supported]:
        rig = _rig(case)
        assert gpu_check.blocks_equal(rig)
        block = rig.dst[1].select(case.block_axis, rig.dst_ids[2]).view(torch.uint8)
        block[(0,) * (block.dim() - 1) + (-1,)] ^= 1
        assert not gpu_check.blocks_equal(rig), case.name


def test_zeroing_touches_only_the_blocks_a_load_writes() -> None:
    case = next(c for c in gpu_check.CASES if c.name == "flash_attn")
    rig = _rig(case)
    before = [t.clone() for t in rig.src]
    gpu_check.zero_dst(rig)
    for t, b in zip(rig.src, before, strict=True):
        for blk in range(8):
            now, was = t.select(1, blk), b.select(1, blk)
            assert (
                bool((now == 0).all())
                if blk in rig.dst_ids
                else torch.equal(now.view(torch.uint8), was.view(torch.uint8))
            )

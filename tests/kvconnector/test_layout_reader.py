"""The layout reader (kvconnector.layout_reader) for every vLLM attention backend, without a GPU.

Each case's KV is allocated as vLLM 0.32 allocates it: one int8 buffer laid out in the case's
KVCacheLayout over [L, B, H, N, C bytes] (`compute_layout_strides`), viewed per layer as
[B, H, N, C] of the cache dtype (`create_kv_cache_views`). `vllm_views` below rebuilds exactly that
on CPU tensors; `test_vllm_allocates_what_we_rebuild` proves it against vLLM's own functions and
spec classes (from .venv-vllm, in a subprocess) and checks each backend accepts the case's layout.
FlashInfer (needs the flashinfer package) and CUTLASS MLA (needs CUDA) do not import on the CPU
wheel: for them the accepted layouts are the documented ones (FlashInfer: any, NHD = LBNHC and
HND = LBHNC; MLA: any); their specs and views still come from vLLM's real classes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_kv_helpers import module_server
from kvconnector import layouts as L
from kvconnector.layout_reader import UnreadableLayout, read_layout, read_spec_layout
from kvtestkit.backend_layouts import CASES, CHUNK, NUM_LAYERS, SCALES, read, round_trip, vllm_views
from kvtestkit.backend_layouts import case as _case
from kvconnector.vllm.vllm_layout import KVBackend, UnsupportedLayout, engine_backend
from kvprotocol import LayoutDescriptor

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("KV_VLLM_VENV", REPO / ".venv-vllm")) / "bin" / "python"
if not VLLM_PYTHON.exists() and Path("/work/main/.venv-vllm/bin/python").exists():
    VLLM_PYTHON = Path("/work/main/.venv-vllm/bin/python")  # a worktree without its own vLLM venv
PROBE = Path(__file__).with_name("vllm_layout_probe.py")
# ---- the descriptors ---------------------------------------------------------------------------


def test_the_cpu_backends_give_todays_descriptors() -> None:
    cpu = read("cpu/LBHNC/bf16").layout
    today = L.vllm_cpu_layout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype="bfloat16", chunk_size=64)
    assert cpu == dataclasses.replace(today, variant="vec")
    mla = read("cpu_mla/LBNHC/bf16").layout
    today_mla = L.mla_layout(num_layers=2, latent_dim=72, block_size=16, dtype="bfloat16", chunk_size=64, shared=True)
    assert mla == dataclasses.replace(today_mla, variant="cpu_mla")


def test_fingerprints_differ_exactly_when_block_bytes_differ() -> None:
    fp = {name: read(name).layout.fingerprint for name in CASES}
    # the same block bytes: FlashAttention, Triton, Flex and FlashInfer NHD share objects; a block-outer
    # order (BLNHC) or padding between blocks changes where blocks live, not what a block holds
    assert fp["triton/LBNHC/bf16"] == fp["flash_attn/LBNHC/bf16"] == fp["flash_attn/LBNHC/bf16/padded"]
    assert fp["flex/LBNHC/fp16"] == fp["flashinfer/NHD/fp16"] == read("flash_attn/BLNHC/fp16").layout.fingerprint
    # everything else differs: interior order, dtype, fp8 kind, backend packing (CPU), MLA
    distinct = {
        fp["flash_attn/LBNHC/bf16"],
        fp["flashinfer/HND/bf16"],  # HND vs NHD, with H == 2 != N
        read("flashinfer/HND/bf16", heads=16).layout.fingerprint,  # H == N == 16: the tag still differs
        read("flash_attn/LBNHC/bf16", heads=16).layout.fingerprint,
        fp["flash_attn/BLNHC/fp16"],
        fp["flash_attn/LBNHC/fp8_e4m3"],
        read("flash_attn/LBNHC/fp8_e4m3", cache_dtype="fp8_e5m2").layout.fingerprint,
        read("flash_attn/LBNHC/bf16", block_size=32).layout.fingerprint,
        fp["cpu/LBHNC/bf16"],
        fp["flashmla/LBNHC/bf16"],
        fp["cpu_mla/LBNHC/bf16"],
        fp["triton_mla/BLNHC/fp8_e4m3"],
    }
    assert len(distinct) == 12
    # MLA: one latent per token, the same on every rank; H == 1 so every order holds the same bytes
    mla = read("flashmla/LBNHC/bf16").layout
    assert mla.shared and mla.tag == "mla" and mla.block_shape == (16, 72)
    assert (
        read("cutlass_mla/LBHNC/fp16").layout.fingerprint
        == read("flashmla/LBNHC/bf16", dtype="float16").layout.fingerprint
    )


def test_fp8_scales_are_part_of_the_fingerprint() -> None:
    a = read("flash_attn/LBNHC/fp8_e4m3").layout
    assert a.dtype == "float8_e4m3fn" and len(a.scales) == 16
    other = read_layout(
        order="LBNHC",
        backend="FLASH_ATTN",
        num_layers=2,
        block_size=16,
        num_kv_heads=2,
        head_size=16,
        spec_dtype="uint8",
        cache_dtype="fp8",
        kv_scales=[(0.5, 0.25), (1.0, 2.0000001)],
        chunk_size=CHUNK,
    ).layout
    assert other.fingerprint != a.fingerprint and other.block_bytes == a.block_bytes
    assert LayoutDescriptor.from_wire(a.to_wire()) == a  # as the server sees it
    assert "scales" not in read("flash_attn/LBNHC/bf16").layout.to_wire()  # older servers accept it
    with pytest.raises(UnreadableLayout, match="k_scale"):
        read_layout(
            order="LBNHC",
            backend="FLASH_ATTN",
            num_layers=2,
            block_size=16,
            num_kv_heads=2,
            head_size=16,
            spec_dtype="uint8",
            cache_dtype="fp8",
        )


@pytest.mark.parametrize(
    "change,why",
    [
        (dict(order="LHBNC"), "per-head pieces"),
        (dict(order="BHLNC"), "per-head pieces"),
        (dict(order="XYZ"), "unknown KV cache layout"),
        (dict(backend="TURBOQUANT"), "not one whose blocks"),
        (dict(backend="FLEX_ATTENTION", order="LBHNC"), "does not use"),
        (dict(backend="CPU_ATTN", order="LBNHC", variant="vec"), "does not use"),
        (dict(backend="CPU_ATTN", order="LBHNC"), "variant is required"),
        (dict(cache_dtype="fp8_ds_mla"), "not supported"),
        (dict(cache_dtype="int8_per_token_head"), "not supported"),
        (dict(kv_quant_mode=3), "per-token quantised"),
        (dict(num_head_slots=4), "packed"),
        (dict(state_content_bytes=656), "packed"),
        (dict(tokens_per_state=4), "compressed"),
        (dict(head_size_v=8), "different K and V"),
    ],
)
def test_what_the_reader_cannot_describe_is_refused(change: dict[str, Any], why: str) -> None:
    kw: dict[str, Any] = dict(
        order="LBNHC",
        backend="FLASH_ATTN",
        num_layers=2,
        block_size=16,
        num_kv_heads=2,
        head_size=16,
        spec_dtype="bfloat16",
        chunk_size=CHUNK,
    )
    with pytest.raises(UnreadableLayout, match=why):
        read_layout(**{**kw, **change})


# ---- vLLM's own description (from .venv-vllm) --------------------------------------------------


class _Spec:
    """A vLLM spec's fields as the probe reported them, under its class name (the reader reads by attribute)."""

    def __init__(self, fields: dict[str, Any]) -> None:
        self.__dict__.update(fields)


@pytest.fixture(scope="module")
def probed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"{VLLM_PYTHON} missing: build it with scripts/make-vllm-env.sh")
    path = tmp_path_factory.mktemp("probe") / "cases.json"
    path.write_text(json.dumps({name: _case(name) for name in CASES}))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["VLLM_TARGET_DEVICE"] = "cpu"
    out = subprocess.run(
        [str(VLLM_PYTHON), str(PROBE), str(path)], capture_output=True, text=True, timeout=300, env=env
    )
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("PROBE ")]
    assert out.returncode == 0 and line, out.stderr[-3000:]
    return json.loads(line[0].removeprefix("PROBE "))


@pytest.mark.parametrize("name", sorted(CASES))
def test_vllm_allocates_what_we_rebuild(probed: dict[str, Any], name: str) -> None:
    got, c = probed[name], _case(name)
    raw, views = vllm_views(name, seed=0)
    assert got["size"] == raw.numel()
    for ours, theirs in zip(views, got["views"], strict=True):
        assert list(ours.shape) == theirs["shape"] and list(ours.stride()) == theirs["stride"]
        assert ours.storage_offset() * ours.element_size() == theirs["offset"]
    backend = got["backend"]
    if backend["importable"]:
        assert backend["name"] == c["backend"]
        assert backend["layouts"] is None or c["order"] in backend["layouts"]
    else:  # documented: FlashInfer and the MLA backends accept any layout on non-Blackwell GPUs
        assert c["backend"] in ("FLASHINFER", "CUTLASS_MLA"), backend["why"]
    # the reader gives the same descriptor from vLLM's real spec as from the case's plain fields
    spec = type(got["spec"]["class"], (_Spec,), {})(got["spec"])
    from_spec = read_spec_layout(
        spec,
        order=c["order"],
        backend=c["backend"],
        num_layers=NUM_LAYERS,
        cache_dtype=c["cache_dtype"],
        kv_scales=SCALES if c["cache_dtype"] != "auto" else None,
        chunk_size=CHUNK,
        variant=c.get("variant", ""),
    )
    assert from_spec == read(name)
    assert from_spec.layout.block_bytes <= got["spec"]["page_size_bytes"]


# ---- bytes through a real kvserver -------------------------------------------------------------

kv_server = module_server("--l1-size-gb", "0.1", "--chunk-size", "64", "--lease-ttl", "30")


def _round_trip(server: Any, src_name: str, dst_name: str, backend: str, seed: int) -> None:
    """Save blocks of `src_name`'s engine, load them into other blocks of `dst_name`'s engine, compare
    bytes; every byte outside the loaded blocks (other blocks, padding, other layers' pages) untouched."""
    got = round_trip(server.url, src_name, dst_name, backend, seed)
    assert "error" not in got, got
    assert got["loaded"] == 2 * CHUNK and got["equal"] and got["untouched"], got


@pytest.mark.parametrize("backend", ["host", "torch"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_round_trip_of_each_backend_layout(kv_server: Any, name: str, backend: str) -> None:
    _round_trip(kv_server, name, name, backend, seed=10 + sorted(CASES).index(name) * 2 + (backend == "torch"))


def test_engines_with_the_same_block_bytes_share_objects(kv_server: Any) -> None:
    # FlashAttention with padded pages writes, Triton (LBNHC, no padding) reads: the same block bytes
    _round_trip(kv_server, "flash_attn/LBNHC/bf16/padded", "triton/LBNHC/bf16", "host", seed=99)


# ---- the vLLM connector's two sides (vllm_layout: no vLLM needed, specs are read by class name) ----


def _config(name: str, order: str | None, **spec_fields: Any) -> Any:
    c = _case(name)
    fields = dict(block_size=c["block_size"], num_kv_heads=c["heads"], head_size=c["head_size"])
    fields.update(dtype=getattr(torch, c["dtype"]), head_size_v=0 if c["mla"] else c["head_size"])
    fields.update(spec_fields)
    spec = type("MLAAttentionSpec" if c["mla"] else "FullAttentionSpec", (_Spec,), {})(fields)
    group = _Spec({"kv_cache_spec": spec, "layer_names": [f"l{i}" for i in range(NUM_LAYERS)]})
    return _Spec({"kv_cache_groups": [group], "kv_cache_layout": order})


VEC = KVBackend("CPU_ATTN", "vec")


@pytest.mark.parametrize("name,isa", [("cpu/LBHNC/bf16", "vec"), ("cpu_mla/LBNHC/bf16", "cpu_mla")])
def test_connector_sides_agree_on_vllm_cpu_tensors(name: str, isa: str) -> None:
    from kvconnector.vllm.vllm_layout import scheduler_layout, worker_layout

    config = _config(name, _case(name)["order"])
    _, views = vllm_views(name, seed=3)
    backend = KVBackend(_case(name)["backend"], isa)
    layout, tensors = worker_layout(config, {f"l{i}": v for i, v in enumerate(views)}, CHUNK, backend)
    assert layout == scheduler_layout(config, CHUNK, backend) == read(name).layout
    assert all(t.data_ptr() == v.data_ptr() for t, v in zip(tensors, views, strict=True))  # views, no copies


GPU_CASES = sorted(n for n, c in CASES.items() if "cpu" not in n and c.get("cache_dtype", "auto") == "auto")


def _vllm_config(backend: str | None) -> Any:
    return _Spec({"attention_config": _Spec({"backend": backend})})


@pytest.mark.parametrize("name", GPU_CASES)
def test_connector_sides_agree_on_each_gpu_backends_tensors(name: str) -> None:
    """A CUDA engine (device given, as vLLM's platform would say): the backend the user pinned, the
    scheduler's layout from the spec alone equals the worker's from tensors shaped and strided exactly
    as that backend's vLLM allocates them (here on the CPU: the indexing is the same)."""
    from kvconnector.vllm.vllm_layout import scheduler_layout, worker_layout

    c = _case(name)
    config = _config(name, c["order"])
    backend = engine_backend(_vllm_config(c["backend"]), config, device="cuda")
    assert backend == KVBackend(c["backend"])  # no variant on a GPU: the order names every byte
    _, views = vllm_views(name, seed=7)
    layout, tensors = worker_layout(config, {f"l{i}": v for i, v in enumerate(views)}, CHUNK, backend)
    assert layout == scheduler_layout(config, CHUNK, backend) == read(name).layout
    assert layout.tag in ("vllm_nhd", "vllm_hnd", "mla") and not layout.variant
    assert all(t.data_ptr() == v.data_ptr() for t, v in zip(tensors, views, strict=True))  # views, no copies
    # unpinned, vLLM's CUDA default names the same bytes: the same objects
    default = engine_backend(_vllm_config(None), config, device="cuda")
    assert default.name in ("FLASH_ATTN", "FLASHMLA")
    if c["backend"] != "FLEX_ATTENTION":
        assert scheduler_layout(config, CHUNK, default).fingerprint == layout.fingerprint


def test_gpu_and_cpu_engines_of_one_model_never_share_objects() -> None:
    """The CPU backend packs a block per ISA; a GPU's block is the order's plain bytes: they differ."""
    from kvconnector.vllm.vllm_layout import scheduler_layout

    gpu = scheduler_layout(_config("flashinfer/HND/bf16", "LBHNC"), CHUNK, KVBackend("FLASHINFER"))
    cpu = scheduler_layout(_config("cpu/LBHNC/bf16", "LBHNC"), CHUNK, VEC)
    assert gpu.block_bytes == cpu.block_bytes and gpu.fingerprint != cpu.fingerprint


def test_gpu_backends_the_reader_cannot_describe_disable_the_connector() -> None:
    from kvconnector.vllm.vllm_layout import scheduler_layout, worker_layout

    config = _config("flash_attn/LBNHC/bf16", "LBNHC")
    with pytest.raises(UnsupportedLayout, match="TREE_ATTN is not one whose blocks we can describe"):
        scheduler_layout(config, CHUNK, engine_backend(_vllm_config("TREE_ATTN"), config, device="cuda"))
    hnd = _config("flashinfer/HND/bf16", "LBHNC")
    with pytest.raises(UnsupportedLayout, match="FLEX_ATTENTION does not use the LBHNC"):
        scheduler_layout(hnd, CHUNK, engine_backend(_vllm_config("FLEX_ATTENTION"), hnd, device="cuda"))
    with pytest.raises(UnsupportedLayout, match="KV caches on xpu devices are not supported"):
        engine_backend(_vllm_config(None), config, device="xpu")
    _, views = vllm_views("flash_attn/LBNHC/bf16", seed=8)
    moved = {f"l{i}": v for i, v in enumerate(views)}
    moved["l1"] = moved["l1"].to("meta")  # a layer on another device than the first
    with pytest.raises(UnsupportedLayout, match="layer l1 KV is on meta"):
        worker_layout(config, moved, CHUNK, KVBackend("FLASH_ATTN"))


def test_connector_refuses_what_the_reader_cannot_describe() -> None:
    from kvconnector.vllm.vllm_layout import scheduler_layout, worker_layout

    with pytest.raises(UnsupportedLayout, match="CPU_ATTN does not use the LBNHC"):
        scheduler_layout(_config("cpu/LBHNC/bf16", "LBNHC"), CHUNK, VEC)
    with pytest.raises(UnsupportedLayout, match="fp8 KV caches are not supported yet"):
        scheduler_layout(_config("cpu/LBHNC/bf16", "LBHNC", dtype=torch.uint8), CHUNK, VEC)
    with pytest.raises(UnsupportedLayout, match="splits a block into per-head pieces"):
        scheduler_layout(_config("cpu_mla/LBNHC/bf16", "LHBNC"), CHUNK, KVBackend("CPU_MLA", "cpu_mla"))
    # tensors that are not what the spec describes (one head too many) disable the worker
    config = _config("cpu/LBHNC/bf16", "LBHNC")
    _, views = vllm_views("cpu/LBHNC/bf16", seed=4)
    wrong = {f"l{i}": torch.cat([v, v[:, :1]], dim=1) for i, v in enumerate(views)}
    with pytest.raises(UnsupportedLayout, match="expects"):
        worker_layout(config, wrong, CHUNK, VEC)


def _hybrid_config(second: str, **fields: Any) -> Any:
    """Two KV cache groups as vLLM's hybrid manager gives them: a full-attention group (l0, l1) and
    a second group (l2, l3) of class `second` (a sliding window, a Mamba state)."""
    one = _config("cpu/LBHNC/bf16", "LBHNC")
    full = one.kv_cache_groups[0]
    spec = type(second, (_Spec,), {})({**full.kv_cache_spec.__dict__, **fields})
    other = _Spec({"kv_cache_spec": spec, "layer_names": [f"l{i + NUM_LAYERS}" for i in range(NUM_LAYERS)]})
    return _Spec({"kv_cache_groups": [full, other], "kv_cache_layout": "LBHNC"})


def test_hybrid_groups_become_object_groups_in_vllm_order() -> None:
    """KV cache group i is object group i: a full group and a sliding group, the same on both sides;
    a single-group engine's layout is exactly today's (its fingerprint is pinned)."""
    from kvconnector.vllm.vllm_layout import scheduler_layout, scheduler_layouts, worker_layouts

    single = _config("cpu/LBHNC/bf16", "LBHNC")
    assert scheduler_layouts(single, CHUNK, VEC) == [scheduler_layout(single, CHUNK, VEC)]
    config = _hybrid_config("SlidingWindowSpec", sliding_window=40)
    _, views = vllm_views("cpu/LBHNC/bf16", seed=5)
    _, more = vllm_views("cpu/LBHNC/bf16", seed=6)
    layouts, groups = worker_layouts(config, {f"l{i}": v for i, v in enumerate(views + more)}, CHUNK, VEC)
    assert layouts == scheduler_layouts(config, CHUNK, VEC)
    assert [(x.kind, x.window) for x in layouts] == [("full", 0), ("sliding", 40)]
    assert layouts[0] == scheduler_layout(single, CHUNK, VEC)  # the full group: today's bytes and keys
    assert [[t.data_ptr() for t in g] for g in groups] == [[v.data_ptr() for v in views], [v.data_ptr() for v in more]]


def test_hybrid_with_states_vllm_keeps_no_boundary_of_is_refused_in_one_line() -> None:
    """A state group in mamba_cache_mode "none" (no prefix caching: one running state per request,
    none at block boundaries) has nothing to cache: the connector says so in one line. ("align"
    state groups are object groups: tests/kvconnector/test_state_layout.py, tests/vllm.)"""
    from kvconnector.vllm.vllm_layout import UnsupportedLayout, scheduler_layouts

    config = _hybrid_config("MambaSpec", mamba_type=_Spec({"name": "GDN_ATTN"}), mamba_cache_mode="none")
    with pytest.raises(
        UnsupportedLayout, match=r"^2 KV cache groups \(hybrid manager\): .*GDN_ATTN, mamba_cache_mode 'none'"
    ):
        scheduler_layouts(config, CHUNK, VEC)

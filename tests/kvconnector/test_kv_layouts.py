"""Layout constructors, inference from tensors, and fingerprints."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvconnector import layouts
from kvprotocol import LayoutDescriptor


def test_constructors_compute_block_bytes_and_shapes():
    v = layouts.vllm_cpu_layout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=128, dtype=torch.float16)
    assert (v.tag, v.dtype, v.block_shape, v.block_bytes) == ("vllm_cpu", "float16", (8, 128, 256), 8 * 128 * 256 * 2)
    assert v.chunk_size == 256 and v.blocks_per_chunk == 2 and v.object_bytes == 32 * 2 * v.block_bytes
    f = layouts.flash_attn_layout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16")
    assert (f.tag, f.block_shape, f.block_bytes) == ("flash_attn", (2, 16, 2, 64), 2 * 16 * 2 * 64 * 2)
    m = layouts.mla_layout(num_layers=3, latent_dim=576, block_size=64, dtype=np.float32, chunk_size=128)
    assert (m.tag, m.block_shape, m.block_bytes, m.blocks_per_chunk) == ("mla", (64, 576), 64 * 576 * 4, 2)


def test_fingerprints_differ_across_dtype_shape_and_tag():
    base = {"num_layers": 4, "num_kv_heads": 2, "head_dim": 64, "block_size": 32}
    fps = {
        layouts.vllm_cpu_layout(**base, dtype="float16").fingerprint,
        layouts.vllm_cpu_layout(**base, dtype="bfloat16").fingerprint,  # same size, other meaning
        layouts.vllm_cpu_layout(**base, dtype="float32").fingerprint,
        layouts.vllm_cpu_layout(**{**base, "num_kv_heads": 4, "head_dim": 32}, dtype="float16").fingerprint,
        layouts.vllm_cpu_layout(**{**base, "num_layers": 5}, dtype="float16").fingerprint,
        layouts.vllm_cpu_layout(**base, dtype="float16", chunk_size=128).fingerprint,
        layouts.flash_attn_layout(**base, dtype="float16").fingerprint,  # same block_bytes, other tag
        layouts.mla_layout(num_layers=4, latent_dim=256, block_size=32, dtype="float16").fingerprint,
    }
    assert len(fps) == 8
    # Same inputs, same name; `stacked` changes the copy segments, not the object bytes.
    a = layouts.vllm_cpu_layout(**base, dtype="float16")
    assert a.fingerprint == layouts.vllm_cpu_layout(**base, dtype=torch.float16, stacked=True).fingerprint
    assert LayoutDescriptor.from_wire(a.to_wire()) == a


@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize(
    "tag,shape,build",
    [
        (
            "vllm_cpu",
            (7, 2, 32, 16),
            lambda: layouts.vllm_cpu_layout(
                num_layers=3, num_kv_heads=2, head_dim=8, block_size=32, dtype="float32", chunk_size=64
            ),
        ),
        (
            "flash_attn",
            (2, 7, 32, 2, 8),
            lambda: layouts.flash_attn_layout(
                num_layers=3, num_kv_heads=2, head_dim=8, block_size=32, dtype="float32", chunk_size=64
            ),
        ),
        (
            "mla",
            (7, 32, 24),
            lambda: layouts.mla_layout(num_layers=3, latent_dim=24, block_size=32, dtype="float32", chunk_size=64),
        ),
    ],
)
def test_layout_from_tensor_matches_constructor(tag, shape, build, stacked):
    t = torch.zeros((3, *shape) if stacked else shape, dtype=torch.float32)
    inferred = layouts.layout_from_tensor(t, tag, block_size=32, chunk_size=64, num_layers=None if stacked else 3)
    assert inferred.fingerprint == build().fingerprint
    assert inferred.stacked is stacked
    # numpy arrays work too
    assert layouts.layout_from_tensor(t.numpy(), tag, 32, 64, 3).fingerprint == inferred.fingerprint


def test_layout_from_tensor_rejects_mismatches():
    with pytest.raises(ValueError):  # wrong tokens per block
        layouts.layout_from_tensor(torch.zeros(4, 2, 16, 8), "vllm_cpu", block_size=32, num_layers=2)
    with pytest.raises(ValueError):  # per-layer tensor without num_layers
        layouts.layout_from_tensor(torch.zeros(4, 2, 32, 8), "vllm_cpu", block_size=32)
    with pytest.raises(ValueError):  # flash_attn needs K and V planes first
        layouts.layout_from_tensor(torch.zeros(3, 4, 32, 2, 8), "flash_attn", block_size=32, num_layers=1)
    with pytest.raises(ValueError):  # stacked layer count disagrees
        layouts.layout_from_tensor(torch.zeros(2, 4, 32, 8), "mla", block_size=32, num_layers=3)
    with pytest.raises(ValueError):
        layouts.layout_from_tensor(torch.zeros(4, 32), "mla", block_size=32, num_layers=1)
    with pytest.raises(ValueError):
        layouts.layout_from_tensor(torch.zeros(4, 32, 8), "paged_xyz", block_size=32, num_layers=1)
    with pytest.raises(ValueError):  # dtype the protocol does not know
        layouts.layout_from_tensor(torch.zeros(4, 32, 8, dtype=torch.float64), "mla", block_size=32, num_layers=1)


def test_dtype_names():
    assert layouts.dtype_name(torch.bfloat16) == "bfloat16"
    assert layouts.dtype_name(torch.half) == "float16"
    assert layouts.dtype_name(np.dtype("float32")) == "float32"
    assert layouts.dtype_name(np.int8) == "int8"
    assert layouts.dtype_name(torch.float8_e4m3fn) == "float8_e4m3fn"
    with pytest.raises(ValueError):
        layouts.dtype_name("complex64")

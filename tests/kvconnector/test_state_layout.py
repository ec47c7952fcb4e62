"""Recurrent-state groups (Mamba/GDN in vLLM's "align" mode) as object groups: the layout from the
spec (what both connector roles compute), the refusals, and the byte views of vLLM's state pages.
vLLM is not imported: a spec class named like vLLM's stands in (vllm_layout tells kinds by name)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from kvconnector.vllm.state_groups import UnsupportedLayout, check_state, state_layout, state_views
from kvprotocol import LayoutDescriptor


class MambaType(enum.Enum):
    GDN_ATTN = "gdn_attn"
    MAMBA2 = "mamba2"


@dataclass(frozen=True)
class MambaSpec:  # the fields of vLLM 0.32's MambaSpec that the connector reads
    shapes: tuple[tuple[int, ...], ...] = ((3, 64), (2, 16, 16))
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32)
    block_size: int = 288
    page_size_padded: int | None = 4096
    mamba_type: MambaType = MambaType.GDN_ATTN
    mamba_cache_mode: str = "align"
    num_speculative_blocks: int = 0

    @property
    def state_content_size_bytes(self) -> int:
        return sum(
            int(torch.tensor([], dtype=d).element_size()) * int(torch.Size(s).numel())
            for s, d in zip(self.shapes, self.dtypes)
        )

    @property
    def page_size_bytes(self) -> int:
        return self.page_size_padded or self.state_content_size_bytes


CONTENT = 3 * 64 * 2 + 2 * 16 * 16 * 4  # conv (bf16) then ssm (fp32) states of one layer


def test_a_state_layout_is_one_page_of_content_per_chunk() -> None:
    lay = state_layout(MambaSpec(), num_layers=2, chunk_size=288)  # type: ignore[arg-type]
    assert (lay.kind, lay.tag, lay.dtype, lay.block_size, lay.chunk_size) == ("state", "state_page", "uint8", 288, 288)
    assert lay.block_bytes == CONTENT and lay.blocks_per_chunk == 1  # vLLM's padding is not copied
    assert lay.object_bytes == 2 * CONTENT
    assert LayoutDescriptor.from_wire(lay.to_wire()).fingerprint == lay.fingerprint  # as the server sees it


def test_the_fingerprint_names_the_states_kind_shapes_and_dtypes() -> None:
    base = state_layout(MambaSpec(), 2, 288)  # type: ignore[arg-type]
    assert base.fingerprint == state_layout(MambaSpec(), 2, 288).fingerprint  # type: ignore[arg-type]
    others = [
        MambaSpec(dtypes=(torch.bfloat16, torch.bfloat16)),
        MambaSpec(shapes=((3, 64), (2, 16, 8))),
        MambaSpec(mamba_type=MambaType.MAMBA2),
    ]
    prints = {state_layout(s, 2, 288).fingerprint for s in others}  # type: ignore[arg-type]
    assert len(prints) == 3 and base.fingerprint not in prints


def test_a_chunk_size_other_than_vllms_block_refuses_to_start() -> None:
    """A state exists only at vLLM's block boundaries: one chunk per block, else a clear error."""
    with pytest.raises(ValueError, match="chunk_size 256 must equal vLLM's block size 288") as err:
        state_layout(MambaSpec(), 2, 256)  # type: ignore[arg-type]
    assert not isinstance(err.value, UnsupportedLayout)  # an error at start, not a silent uncached engine


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        (MambaSpec(mamba_cache_mode="none"), "only in mamba_cache_mode 'align'"),
        (MambaSpec(mamba_cache_mode="all"), "only in mamba_cache_mode 'align'"),
        (MambaSpec(num_speculative_blocks=1), "speculative blocks"),
    ],
)
def test_state_groups_vllm_does_not_keep_at_boundaries_are_refused(spec: MambaSpec, why: str) -> None:
    with pytest.raises(UnsupportedLayout, match=why):
        check_state(spec)  # type: ignore[arg-type]


def _page_views(num_blocks: int, page: int) -> torch.Tensor:
    """What vLLM's CPU runner registers for a state layer: an int8 view [num_blocks, 1, 1, page]."""
    return torch.arange(num_blocks * page, dtype=torch.int64).remainder(251).to(torch.int8).view(num_blocks, 1, 1, page)


def test_page_views_read_each_blocks_state_content() -> None:
    spec = MambaSpec()
    pages = [_page_views(5, spec.page_size_bytes), _page_views(5, spec.page_size_bytes) + 1]
    cfg = SimpleNamespace(kv_cache_tensors=[])
    lay, views = state_views(cfg, ["l0", "l1"], spec, {"l0": pages[0], "l1": pages[1]}, 288)  # type: ignore[arg-type]
    assert lay == state_layout(spec, 2, 288)  # type: ignore[arg-type]
    for view, page in zip(views, pages, strict=True):
        assert view.shape == (5, CONTENT) and view.dtype == torch.uint8
        for b in range(5):  # the same bytes, in place: a write through the view lands in vLLM's page
            assert torch.equal(view[b], page[b, 0, 0, :CONTENT].view(torch.uint8))
            assert view[b].data_ptr() == page[b].data_ptr()


def test_backing_allocation_views_follow_the_kv_cache_tensor_placement() -> None:
    """vLLM may register the whole allocation: layer l's page of block b is at
    offset + l * layer_stride + b * block_stride (here block-outermost: layers interleaved)."""
    spec = MambaSpec()
    page, blocks = spec.page_size_bytes, 4
    buf = torch.arange(2 * blocks * page + 64, dtype=torch.int64).remainder(253).to(torch.int8)
    placed = SimpleNamespace(layers=["l0", "l1"], offset=64, layer_stride=page, block_stride=2 * page)
    cfg = SimpleNamespace(kv_cache_tensors=[placed], num_blocks_of=lambda t: blocks)
    _, views = state_views(cfg, ["l0", "l1"], spec, {"l0": buf, "l1": buf}, 288)  # type: ignore[arg-type]
    for layer, view in enumerate(views):
        for b in range(blocks):
            start = 64 + layer * page + b * 2 * page
            assert torch.equal(view[b], buf[start : start + CONTENT].view(torch.uint8))


def test_state_pages_smaller_than_the_spec_are_refused() -> None:
    spec = MambaSpec()
    with pytest.raises(UnsupportedLayout, match="less than the spec"):
        state_views(SimpleNamespace(kv_cache_tensors=[]), ["l0"], spec, {"l0": _page_views(3, CONTENT - 2)}, 288)  # type: ignore[arg-type]
    with pytest.raises(UnsupportedLayout, match="int8 state pages"):
        state_views(SimpleNamespace(kv_cache_tensors=[]), ["l0"], spec, {"l0": torch.zeros(3, 1, 1, 4096)}, 288)  # type: ignore[arg-type]

"""kvprotocol._geometry: which objects a hit needs and a store writes, per group kind, and the fold."""

from __future__ import annotations

from dataclasses import replace

import msgpack
import pytest
from blake3 import blake3

from kvprotocol import GroupGeometry, LayoutDescriptor, ValidationError, prefix_hit

U = 64
BASE = LayoutDescriptor("vllm_cpu", "float32", 2, 16, 1024, U)


def test_full_attention_with_one_unit_per_object_is_the_old_rule() -> None:
    geo = GroupGeometry.of(BASE, U)
    assert geo.trivial and list(geo.needed(3, U)) == [0, 1, 2] and list(geo.stored(1, 4, U)) == [1, 2, 3]
    assert prefix_hit([geo], 5, U, lambda g, c: c != 3) == 3  # a hole ends the prefix


def test_larger_chunks_are_named_by_their_last_unit() -> None:
    geo = GroupGeometry.of(replace(BASE, chunk_size=2 * U), U)
    assert geo.units == 2 and [geo.end_unit(j) for j in range(3)] == [1, 3, 5]
    assert list(geo.stored(0, 5, U)) == [0, 1]  # the object ending at unit 5 is not complete
    assert list(geo.stored(3, 6, U)) == [1, 2]  # the object holding unit 3 is not stored yet
    assert list(geo.needed(3, U)) == [0, 1]  # the second object is used in part
    with pytest.raises(ValueError):
        GroupGeometry.of(replace(BASE, chunk_size=96), U)


def test_sliding_snapshots_and_states_are_exact() -> None:
    sw = GroupGeometry.of(replace(BASE, kind="sliding", window=100), U)
    st = GroupGeometry.of(replace(BASE, kind="state", chunk_size=2 * U), U)
    assert replace(BASE, kind="sliding", window=100).blocks_per_chunk == 7
    assert list(sw.needed(5, U)) == [4] and list(sw.stored(0, 5, U)) == [4] and list(sw.stored(5, 5, U)) == []
    assert list(st.needed(4, U)) == [1] and list(st.needed(3, U)) == [] and list(st.stored(0, 3, U)) == []
    full = GroupGeometry.of(BASE, U)
    present = {(0, c) for c in range(6)} | {(1, 2), (1, 4)}  # snapshots at units 3 and 5 (ends 2 and 4)
    assert prefix_hit([full, sw], 6, U, lambda g, c: (g, c) in present) == 5
    present.discard((1, 4))
    assert prefix_hit([full, sw], 6, U, lambda g, c: (g, c) in present) == 3  # not bridged to 5 or 6
    present.discard((0, 1))
    assert prefix_hit([full, sw], 6, U, lambda g, c: (g, c) in present) == 0  # the full prefix ends at 1


def test_layout_kinds_are_checked_and_fingerprinted() -> None:
    old = [BASE.tag, BASE.dtype, 2, 16, 1024, U, [], ""]  # the canon before kinds existed: unchanged
    assert BASE.fingerprint == blake3(b"kv-layout-v1" + msgpack.packb(old)).hexdigest()[:16]
    fps = {
        BASE.fingerprint,
        replace(BASE, shared=True).fingerprint,
        replace(BASE, kind="state").fingerprint,
        replace(BASE, kind="sliding", window=64).fingerprint,
        replace(BASE, kind="sliding", window=65).fingerprint,
    }
    assert len(fps) == 5
    for bad in ({"kind": "mamba"}, {"kind": "sliding"}, {"window": 64}):
        with pytest.raises(ValidationError, match=r"kind|window"):
            replace(BASE, **bad)
    assert LayoutDescriptor.from_wire(replace(BASE, kind="sliding", window=64).to_wire()).window == 64

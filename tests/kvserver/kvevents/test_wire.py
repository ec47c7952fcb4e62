"""The hand-assembled msgpack of a batch equals what msgpack (and so msgspec) writes for the same values."""

from __future__ import annotations

import numpy as np
import pytest

import msgpack
from kvserver.kvevents.wire import (
    all_blocks_cleared,
    block_removed,
    block_stored,
    decode_batch,
    encode_batch,
    external_hash,
    pack_uint_array,
)

EDGES = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**31, 2**32 - 1]


@pytest.mark.parametrize(
    "values",
    [
        [],
        EDGES,
        list(range(15)),
        list(range(16)),
        list(range(70_000)),
        np.random.default_rng(0).integers(0, 2**32, 5000, dtype=np.uint64).tolist(),
    ],
)
def test_uint_arrays_pack_in_the_shortest_form(values):
    assert pack_uint_array(np.array(values, dtype=np.uint32)) == msgpack.packb(values)


@pytest.mark.parametrize("n_events", [0, 1, 15, 16, 70_000])
def test_batches_with_token_arrays_equal_plain_msgpack(n_events):
    # 70,000 events cross msgpack's array32 boundary; short token arrays keep that case quick
    tokens = np.arange(100_000, 100_512 if n_events < 1000 else 100_004, dtype=np.uint32)
    h = bytes(range(32))
    kinds = [
        block_stored([h, external_hash(h, "int")], None, tokens, 256, "kvserver_l1"),
        block_removed([h], "kvserver_l2_fs"),
        all_blocks_cleared(),
    ]
    events = [kinds[i % 3] for i in range(n_events)]
    plain = [dict(ev, token_ids=ev["token_ids"].tolist()) if "token_ids" in ev else ev for ev in events]
    payload = encode_batch(1234.5, events)
    assert payload == msgpack.packb([1234.5, plain, 0], use_bin_type=True)
    assert decode_batch(payload) == (1234.5, plain, 0)


def test_int_hashes_are_the_low_64_bits_big_endian():
    h = bytes(24) + (2**64 - 2).to_bytes(8, "big")
    assert external_hash(h, "int") == 2**64 - 2
    assert external_hash(b"\xff" * 32, "int") == 2**64 - 1
    assert external_hash(h, "bytes") is h

"""Per-chunk extra keys folded into the chunk hash chain, checked against a plain reference."""

from __future__ import annotations

import struct

import pytest
from blake3 import blake3

from kvprotocol import ErrorCode, ValidationError, check_extra, chunk_hashes, validate_request
from kvprotocol._messages import PROTOCOL_VERSION


def reference(tokens, c, extra):
    """docs/protocol.md written out: h_i = BLAKE3(h_{i-1} || BE uint32 tokens of chunk i || x_i)."""
    x = dict(extra)
    out, prev = [], bytes(32)
    for i in range(len(tokens) // c):
        data = b"".join(struct.pack(">I", t) for t in tokens[i * c : (i + 1) * c])
        prev = blake3(prev + data + x.get(i, b"")).digest()
        out.append(prev)
    return out


TOKENS = [(i * 2654435761) % (1 << 32) for i in range(1100)]
D1, D2 = blake3(b"adapter-a").digest(), blake3(b"adapter-b").digest()


@pytest.mark.parametrize("extra", [[], [(0, D1)], [(1, D1)], [(0, D1), (1, D2), (3, D1)], [(3, D2)]])
def test_fold_matches_reference(extra):
    assert chunk_hashes(TOKENS, 256, extra) == reference(TOKENS, 256, extra)


def test_plain_chunks_keep_their_keys_and_the_chain_carries_the_extra():
    plain = chunk_hashes(TOKENS, 256)
    folded = chunk_hashes(TOKENS, 256, [(1, D1)])
    assert folded[0] == plain[0]  # no extra on chunk 0: unchanged
    assert folded[1] != plain[1]
    assert all(a != b for a, b in zip(folded[2:], plain[2:]))  # every later chunk depends on it
    assert chunk_hashes(TOKENS, 256, [(1, D2)])[1] != folded[1]


@pytest.mark.parametrize(
    "bad", [[(1, D1), (1, D2)], [(2, D1), (1, D2)], [(0, b"short")], [(-1, D1)], [(True, D1)], [(0,)], [(0, "x" * 32)]]
)
def test_malformed_extra_raises_value_error(bad):
    with pytest.raises(ValueError):
        check_extra(bad)


def test_extra_beyond_the_last_full_chunk_raises():
    with pytest.raises(IndexError):
        chunk_hashes(TOKENS, 256, [(4, D1)])  # 1100 tokens: chunks 0..3


def _msg(extra):
    return {
        "v": PROTOCOL_VERSION,
        "id": 1,
        "op": "lookup",
        "tokens": b"\x00" * 1024,
        "extra": extra,
        "keyspace": {"model": "m", "world_size": 1, "groups": ["0" * 16]},
    }


@pytest.mark.parametrize(
    "extra,code",
    [
        ("x", ErrorCode.BAD_FIELD),
        ([[0, b"\x00" * 31]], ErrorCode.BAD_FIELD),
        ([[1, D1], [0, D2]], ErrorCode.BAD_FIELD),
        ([[0, D1, 3]], ErrorCode.BAD_FIELD),
        ([[-1, D1]], ErrorCode.OUT_OF_RANGE),
        ([[1 << 20, D1]], ErrorCode.OUT_OF_RANGE),
        ([[0, D1]] * 20000, ErrorCode.BAD_FIELD),
    ],
)
def test_schema_refuses_malformed_extra(extra, code):
    with pytest.raises(ValidationError) as info:
        validate_request(_msg(extra))
    assert info.value.code == code


def test_schema_accepts_pairs_as_lists():
    assert validate_request(_msg([[0, D1], [3, D2]]))[2].extra == [(0, D1), (3, D2)]

"""Chunk hashing exactly as specified, and stable across processes and PYTHONHASHSEED."""

from __future__ import annotations

import os
import struct
import subprocess
import sys

import numpy as np
import pytest
from blake3 import blake3

from kvprotocol import ZERO_HASH, chunk_hashes, pack_tokens, unpack_tokens


def reference(tokens, c):
    """The DESIGN.md definition, written out plainly."""
    out, prev = [], bytes(32)
    for i in range(len(tokens) // c):
        data = b"".join(struct.pack(">I", t) for t in tokens[i * c : (i + 1) * c])
        prev = blake3(prev + data).digest()
        out.append(prev)
    return out


@pytest.mark.parametrize("n,c", [(0, 4), (3, 4), (4, 4), (1000, 256), (1030, 16)])
def test_matches_the_definition(n, c):
    tokens = [(i * 2654435761) % (1 << 32) for i in range(n)]
    assert chunk_hashes(tokens, c) == reference(tokens, c)
    assert chunk_hashes(pack_tokens(tokens), c) == reference(tokens, c)
    assert chunk_hashes(np.array(tokens, dtype=np.uint32), c) == reference(tokens, c)


def test_only_full_chunks_and_prefix_dependence():
    a = chunk_hashes(list(range(600)), 256)
    assert len(a) == 2 and ZERO_HASH not in a and all(len(h) == 32 for h in a)
    b = chunk_hashes([1] + list(range(1, 600)), 256)
    assert a[0] != b[0] and a[1] != b[1]  # chunk 1 differs although its own tokens are equal
    assert chunk_hashes(list(range(600)) + [5, 6], 256) == a


def test_same_in_fresh_processes_with_different_hash_seeds():
    code = "import kvprotocol; print(kvprotocol.chunk_hashes(list(range(1024)), 256)[-1].hex())"
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout.strip()
        for seed in ("0", "1", "12345")
    }
    assert outs == {chunk_hashes(list(range(1024)), 256)[-1].hex()}


def test_token_packing_is_checked():
    assert list(unpack_tokens(pack_tokens([0, 1, 0xFFFFFFFF]))) == [0, 1, 0xFFFFFFFF]
    with pytest.raises(ValueError):
        pack_tokens([-1])
    with pytest.raises(ValueError):
        pack_tokens([1 << 32])
    with pytest.raises(ValueError):
        unpack_tokens(b"\x00" * 5)


@pytest.mark.parametrize("start", [0, 1, 3, 4, 9])
def test_a_chain_continued_from_a_known_hash_is_the_tail_of_the_whole_chain(start):
    tokens = [(i * 2654435761) % (1 << 32) for i in range(4 * 256 + 17)]
    extra = [(1, b"\x01" * 32), (3, b"\x02" * 32)]
    whole = chunk_hashes(tokens, 256, extra)
    prev = whole[start - 1] if 0 < start <= len(whole) else ZERO_HASH  # 9: past the last chunk, nothing
    assert chunk_hashes(pack_tokens(tokens), 256, extra, start=start, prev=prev) == whole[start:]
    assert chunk_hashes(np.array(tokens, dtype=np.int64), 256, extra, start=start, prev=prev) == whole[start:]
    with pytest.raises(ValueError):
        chunk_hashes(tokens, 256, start=-1)
    with pytest.raises(ValueError):
        chunk_hashes(tokens, 256, start=1, prev=b"short")


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "uint32", ">u4", "int32", "int64", "uint64"])
def test_numpy_tokens_of_any_integer_dtype_pack_like_a_list(dtype):
    tokens = [0, 1, 255]
    assert pack_tokens(np.array(tokens, dtype=dtype)) == pack_tokens(tokens)


@pytest.mark.parametrize(
    "bad",
    [
        np.array([-1], dtype=np.int64),
        np.array([1 << 32], dtype=np.uint64),
        np.array([1 << 32], dtype=np.int64),
        np.zeros((2, 2), dtype=np.uint32),
    ],
)
def test_numpy_tokens_out_of_range_or_not_one_dimensional_are_refused(bad):
    with pytest.raises(ValueError):
        pack_tokens(bad)
    with pytest.raises(ValueError):
        chunk_hashes(bad, 1)

"""The serde chain: integrity header, compression, AES-GCM; every kind of damage is refused."""

from __future__ import annotations

import os
import struct

import pytest
import xxhash
from blake3 import blake3
from hypothesis import given, settings
from hypothesis import strategies as st
from kvprotocol import ObjectKey
from kvserver.l2.serde import (
    HEADER,
    HEADER_BYTES,
    CorruptObject,
    Serde,
    UndecryptableObject,
    _checksum,
    fingerprint,
    load_key,
    parse_key,
)

KEY = ObjectKey("m", "0123456789abcdef", 1, 0, 0, "", bytes(32)).to_str()
OTHER = ObjectKey("m", "0123456789abcdef", 1, 0, 0, "", bytes([1]) * 32).to_str()
AES = bytes(range(32))
PAYLOAD = bytes(4096) + os.urandom(4096)  # half compressible
CS = 0xFEDCBA9876543210  # the object's kvsum64, as the writer committed it
CHAINS = [Serde(c, k) for c in ("none", "lz4", "zstd") for k in (None, AES)]


def test_fingerprint_matches_objectkey() -> None:
    ok = ObjectKey("m", "0123456789abcdef", 2, 1, 3, "tenant", bytes([7]) * 32)
    assert fingerprint(ok.to_str()) == ok.fingerprint()


@pytest.mark.parametrize("serde", CHAINS, ids=repr)
def test_round_trip_every_chain(serde: Serde) -> None:
    blob = serde.encode(KEY, PAYLOAD, CS)
    assert bytes(serde.decode(KEY, blob)) == PAYLOAD
    payload, checksum = serde.decode_object(KEY, blob)
    assert bytes(payload) == PAYLOAD and checksum == CS
    assert blob[:4] == b"KVL2"
    if serde.compression != "none":
        assert len(blob) < len(PAYLOAD)  # the zero half compresses
    if serde.encrypted:
        assert PAYLOAD[4096:4160] not in blob


def test_incompressible_payload_is_stored_plain() -> None:
    payload = os.urandom(10000)
    blob = Serde("zstd").encode(KEY, payload, CS)
    assert blob[5] == 0 and len(blob) == HEADER_BYTES + len(payload)


def test_any_chain_reads_what_another_wrote() -> None:
    for writer in ("lz4", "zstd", "none"):
        blob = Serde(writer).encode(KEY, PAYLOAD, CS)
        assert bytes(Serde("none").decode(KEY, blob)) == PAYLOAD


@settings(max_examples=150, deadline=None)
@given(position=st.integers(min_value=0), bit=st.integers(min_value=0, max_value=7), chain=st.sampled_from(CHAINS))
def test_any_bit_flip_is_caught(position: int, bit: int, chain: Serde) -> None:
    blob = bytearray(chain.encode(KEY, PAYLOAD, CS))
    blob[position % len(blob)] ^= 1 << bit
    with pytest.raises(CorruptObject):
        chain.decode(KEY, bytes(blob))


@pytest.mark.parametrize("keep", [0, 3, HEADER_BYTES - 1, HEADER_BYTES, HEADER_BYTES + 100, -1])
def test_truncation_is_caught(keep: int) -> None:
    blob = Serde("lz4").encode(KEY, PAYLOAD, CS)
    with pytest.raises(CorruptObject, match=r"truncated|bad magic"):
        Serde("lz4").decode(KEY, blob[:keep])


def test_misplaced_object_is_caught() -> None:
    blob = Serde().encode(KEY, PAYLOAD, CS)
    with pytest.raises(CorruptObject, match="fingerprint"):
        Serde().decode(OTHER, blob)


def _reforge(blob: bytes, new_key: str) -> bytes:
    """What an attacker with write access does: move a blob and fix up fingerprint and checksum."""
    magic, ver, comp, enc, _fp, plen, blen, cs = HEADER.unpack(blob[: HEADER.size])
    head = HEADER.pack(magic, ver, comp, enc, fingerprint(new_key), plen, blen, cs)
    body = blob[HEADER_BYTES:]
    return head + _checksum(head, body) + body


def test_moved_ciphertext_does_not_open_under_another_key() -> None:
    serde = Serde("none", AES)
    moved = _reforge(serde.encode(KEY, PAYLOAD, CS), OTHER)
    with pytest.raises(UndecryptableObject, match="authentication failed"):
        serde.decode(OTHER, moved)
    plain = Serde()  # without encryption a re-forged move is not detectable, which is why AAD matters
    assert bytes(plain.decode(OTHER, _reforge(plain.encode(KEY, PAYLOAD, CS), OTHER))) == PAYLOAD


def test_wrong_key_missing_key_and_plaintext_policy() -> None:
    blob = Serde("zstd", AES).encode(KEY, PAYLOAD, CS)
    with pytest.raises(UndecryptableObject, match="authentication failed"):
        Serde("zstd", bytes(32)).decode(KEY, blob)
    with pytest.raises(UndecryptableObject, match="no L2 key"):
        Serde().decode(KEY, blob)
    with pytest.raises(UndecryptableObject, match="plaintext object refused"):
        Serde("none", AES).decode(KEY, Serde().encode(KEY, PAYLOAD, CS))


def test_header_layout_is_as_documented() -> None:
    blob = Serde("lz4").encode(KEY, PAYLOAD, CS)
    assert HEADER_BYTES == 64
    magic, version, comp, enc, fp, plen, blen, cs = struct.unpack_from("<4sBBBx16sQQQ", blob)
    assert (magic, version, comp, enc, fp, plen, cs) == (b"KVL2", 3, 1, 0, fingerprint(KEY), len(PAYLOAD), CS)
    assert blen == len(blob) - 64
    assert blob[48:64] == xxhash.xxh3_128(blob[:48] + blob[64:]).digest()


def _version_2_blob(payload: bytes) -> bytes:
    """A blob as the previous release wrote it (80-byte header, BLAKE3 checksum), built by hand."""
    head = struct.pack("<4sBBBx16sQQQ", b"KVL2", 2, 0, 0, fingerprint(KEY), len(payload), len(payload), CS)
    return head + blake3(head + payload).digest() + payload


def test_version_2_blobs_still_read_and_damage_is_still_caught() -> None:
    old = _version_2_blob(PAYLOAD)
    assert Serde().decode_object(KEY, old) == (PAYLOAD, CS)
    flipped = bytearray(old)
    flipped[100] ^= 1
    with pytest.raises(CorruptObject, match="checksum mismatch"):
        Serde().decode(KEY, bytes(flipped))


def test_encode_parts_leave_a_plain_body_uncopied() -> None:
    payload = bytearray(PAYLOAD)
    head, body = Serde().encode_parts(KEY, memoryview(payload), CS)
    assert len(head) == HEADER_BYTES and isinstance(body, memoryview) and body.obj is payload
    assert head + bytes(body) == Serde().encode(KEY, PAYLOAD, CS)


def test_verify_in_place() -> None:
    head, body = Serde().encode_parts(KEY, PAYLOAD, CS)
    slot = memoryview(bytearray(body))
    assert Serde().verify_in_place(KEY, head, slot) == CS
    packed = Serde("lz4").encode(KEY, PAYLOAD, CS)  # not plain: the caller decodes it whole
    assert Serde().verify_in_place(KEY, packed[:HEADER_BYTES], memoryview(bytearray(len(packed) - 64))) is None
    with pytest.raises(CorruptObject, match="fingerprint"):
        Serde().verify_in_place(OTHER, head, slot)
    with pytest.raises(UndecryptableObject, match="plaintext object refused"):
        Serde("none", AES).verify_in_place(KEY, head, slot)
    slot[4000] ^= 0x40
    with pytest.raises(CorruptObject, match="checksum mismatch"):
        Serde().verify_in_place(KEY, head, slot)
    with pytest.raises(CorruptObject, match="length"):
        Serde().verify_in_place(KEY, head, slot[:-1])
    with pytest.raises(ValueError, match="64 bytes"):
        Serde().verify_in_place(KEY, head[:-1], slot)


def test_checksum_field_is_covered_by_the_integrity_hash() -> None:
    blob = bytearray(Serde().encode(KEY, PAYLOAD, CS))
    blob[HEADER.size - 8] ^= 1  # one bit of the stored kvsum64
    with pytest.raises(CorruptObject, match="checksum mismatch"):
        Serde().decode_object(KEY, bytes(blob))


def test_version_1_blobs_are_refused() -> None:
    blob = bytearray(Serde().encode(KEY, PAYLOAD, CS))
    blob[4] = 1
    with pytest.raises(CorruptObject, match="version"):
        Serde().decode(KEY, bytes(blob))


def test_key_parsing_and_loading(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    assert parse_key(AES.hex(), source="x") == AES
    import base64

    assert parse_key(base64.b64encode(AES).decode() + "\n", source="x") == AES
    raw = tmp_path / "raw.key"
    raw.write_bytes(b"\xff" * 32)
    assert load_key(str(raw), {}) == b"\xff" * 32
    assert load_key(None, {"KVSERVER_L2_ENCRYPTION_KEY": AES.hex()}) == AES
    assert load_key(None, {}) is None
    secret = "ab" * 7  # 7 bytes: too short
    with pytest.raises(ValueError) as info:
        load_key(None, {"KVSERVER_L2_ENCRYPTION_KEY": secret})
    assert secret not in str(info.value)
    with pytest.raises(ValueError, match="not both"):
        load_key(str(raw), {"KVSERVER_L2_ENCRYPTION_KEY": AES.hex()})
    with pytest.raises(ValueError, match="cannot read"):
        load_key(str(tmp_path / "missing"), {})
    assert "key=" not in repr(Serde("none", AES)) and AES.hex() not in repr(Serde("none", AES))

"""ObjectKey and layout validation, and fingerprints that change with meaning."""

from __future__ import annotations

import dataclasses

import pytest

from kvprotocol import SHARED_RANK, LayoutDescriptor, ObjectKey, ValidationError

H = bytes(range(32))
BASE = LayoutDescriptor("vllm_cpu", "float32", 2, 32, 16384, 256, (2, 32, 64))


def test_fingerprint_changes_with_every_field_that_changes_the_bytes():
    variants = [
        dataclasses.replace(BASE, dtype="bfloat16"),
        dataclasses.replace(BASE, tag="flash_attn"),
        dataclasses.replace(BASE, num_layers=3),
        dataclasses.replace(BASE, block_size=64),
        dataclasses.replace(BASE, block_bytes=8192),
        dataclasses.replace(BASE, chunk_size=512),
        dataclasses.replace(BASE, block_shape=(2, 32, 32)),
        dataclasses.replace(BASE, variant="amx"),
    ]
    fps = {v.fingerprint for v in variants} | {BASE.fingerprint}
    assert len(fps) == len(variants) + 1
    assert BASE.fingerprint == LayoutDescriptor.from_wire(BASE.to_wire()).fingerprint


@pytest.mark.parametrize(
    "bad",
    [
        dict(tag="Bad Tag"),
        dict(dtype="float128"),
        dict(num_layers=0),
        dict(block_size=0),
        dict(chunk_size=100),
        dict(block_bytes=-1),
        dict(block_shape=(0,)),
        dict(variant="AMX!"),
    ],
)
def test_bad_layouts_are_rejected(bad):
    with pytest.raises(ValidationError):
        dataclasses.replace(BASE, **bad)


def test_object_key_string_is_stable_and_hides_the_salt():
    k = ObjectKey("org/model-7B", BASE.fingerprint, 2, 1, 0, "tenant-secret", H)
    s = k.to_str()
    assert "tenant-secret" not in s and H.hex() in s and "w2r1" in s
    assert s == ObjectKey("org/model-7B", BASE.fingerprint, 2, 1, 0, "tenant-secret", H).to_str()
    assert ObjectKey("org/model-7B", BASE.fingerprint, 2, 1, 0, "other", H).to_str() != s
    assert len(k.fingerprint()) == 16


@pytest.mark.parametrize(
    "bad",
    [
        dict(model=""),
        dict(model="a b"),
        dict(model="x" * 300),
        dict(salt="s" * 200),
        dict(salt="no spaces"),
        dict(kv_rank=2),
        dict(world_size=0),
        dict(group=64),
        dict(chunk_hash=b"short"),
        dict(layout_fingerprint="XYZ"),
    ],
)
def test_bad_keys_are_rejected(bad):
    fields = dict(
        model="m", layout_fingerprint=BASE.fingerprint, world_size=2, kv_rank=1, group=0, salt="", chunk_hash=H
    )
    good = ObjectKey(**fields)
    assert good.validate() is good
    with pytest.raises(ValidationError):
        ObjectKey(**{**fields, **bad}).validate()


def test_key_strings_and_fingerprints_are_pinned():
    """L2 names objects by these bytes: a release that changed them could not read what an older one
    stored. The literals are what the key type wrote before it became a NamedTuple."""
    k = ObjectKey("org/model-7B", "0123456789abcdef", 2, 1, 3, "tenant-secret", H)
    assert k.to_str() == (
        "kv1/org/model-7B/0123456789abcdef/w2r1/g3/bea9a9ce2b16862f/"
        "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f"
    )
    assert k.fingerprint().hex() == "a2725d717de85e3a15f89e0e20434721"
    shared = ObjectKey("m", "fedcba9876543210", 4, SHARED_RANK, 0, "", H)
    assert shared.to_str() == "kv1/m/fedcba9876543210/w4rs/g0/-/" + H.hex()
    assert shared.fingerprint().hex() == "0efe669fd2e136cad1d5145c9161e114"


def test_a_key_hashes_and_compares_as_its_plain_tuple():
    """What lets the server key its dicts by ObjectKey at tuple speed (and unpack it like one)."""
    parts = ("m", "fedcba9876543210", 1, 0, 0, "", H)
    k = ObjectKey(*parts)
    assert k == parts and hash(k) == hash(parts) and {parts: 1}[k] == 1
    assert (k.model, k.kv_rank, k.chunk_hash) == ("m", 0, H)


def test_to_wire_names_every_descriptor_field_in_order():
    """LayoutWire (a TypedDict) is spelled out field by field: it must follow the dataclass."""
    from kvprotocol._layout import LayoutWire

    names = [f.name for f in dataclasses.fields(LayoutDescriptor)]
    assert list(LayoutWire.__annotations__) == names
    lay = LayoutDescriptor("vllm_cpu", "float16", 2, 16, 4096, 256, (2, 16, 64))
    wire = lay.to_wire()
    assert list(wire) == [n for n in names if n != "scales"]  # unset scales stay off the wire
    assert wire == {**{n: getattr(lay, n) for n in names if n != "scales"}, "block_shape": [2, 16, 64]}
    assert LayoutDescriptor.from_wire(wire) == lay
    scaled = dataclasses.replace(lay, dtype="float8_e4m3fn", block_bytes=2048, scales="0123456789abcdef")
    assert scaled.to_wire()["scales"] == "0123456789abcdef"
    assert LayoutDescriptor.from_wire(scaled.to_wire()) == scaled

"""The serde chain at the L2 boundary: integrity header, optional compression, optional AES-GCM.

Every blob below L1 is `header (64 bytes) || body`; the layout is given byte by byte in docs/l2.md.
The header carries the object's key fingerprint, the object's kvsum64 (the writer's checksum, kept so
a prefetched object is verified by the engine like any other) and an XXH3-128 checksum over the
header and body, so a corrupt, truncated or misplaced blob is detected before anything is
decompressed or served. XXH3 (the `xxhash` library) runs at ~35 GB/s on one core, so checking a body
costs a fraction of reading it; BLAKE3 (version 2 blobs, 80-byte header, still read) ran at ~3 GB/s.
A plain body (no compression, no encryption) is the payload itself: the fs tier writes it straight
from the L1 slot (`encode_parts`) and reads it straight into one (`verify_in_place`).
Compression is applied first and kept only when it shrinks the payload (KV bytes are often
incompressible); encryption (AES-GCM, 96-bit random nonce) comes last and binds the object key as
associated data, so a ciphertext moved under another key does not open. Decoding is self-describing:
a server reads lz4, zstd and plain blobs whatever it writes.
"""

from __future__ import annotations

import base64
import binascii
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass

from typing import Any

import lz4.block
import xxhash
from blake3 import blake3

from .extras import require

MAGIC = b"KVL2"
VERSION = 3  # 2: + the object's kvsum64; 3: XXH3-128 instead of BLAKE3 (a 64-byte header)
HEADER = struct.Struct("<4sBBBx16sQQQ")  # magic, version, compression, encryption, pad, fingerprint, lengths, kvsum64
DIGEST_BYTES = {2: 32, 3: 16}  # the checksum after the fixed header, per version read
HEADER_BYTES = HEADER.size + DIGEST_BYTES[VERSION]  # what this version writes: 64
COMPRESSIONS = {"none": 0, "lz4": 1, "zstd": 2}
ENC_NONE, ENC_AES_GCM = 0, 1
NONCE_BYTES, TAG_BYTES = 12, 16
MAX_PAYLOAD = 1 << 33
KEY_ENV = "KVSERVER_L2_ENCRYPTION_KEY"


class CorruptObject(Exception):
    """The blob is damaged or stored under the wrong key: a miss, and the tier should delete it."""


class UndecryptableObject(Exception):
    """The blob is intact but cannot be opened with this server's key (or policy): a miss, kept."""


def fingerprint(key: str) -> bytes:
    """16-byte key fingerprint; equals `kvprotocol.ObjectKey.fingerprint()` for `key = ok.to_str()`."""
    return blake3(key.encode()).digest()[:16]


def _checksum(header: bytes, body: bytes | memoryview, version: int = VERSION) -> bytes:
    """The digest stored after the fixed header: XXH3-128 (version 3) or BLAKE3 (version 2)."""
    h = xxhash.xxh3_128(header) if version == 3 else blake3(header)
    h.update(body)
    return h.digest()


@dataclass(frozen=True)
class Serde:
    """Encode/decode blobs for one server: its compression choice and optional AES key.

    `hash_landed=False`: `verify_in_place` checks a plain blob's header but not its body's XXH3.
    The body's kvsum64 (in the header) is what every reader verifies on its copy anyway, and a
    damaged object is reported and dropped (kvserver/service/corruption.py): the second pass over
    the bytes at arrival, a visible share of a read from the page cache, buys nothing a reader misses.
    """

    compression: str = "none"
    key: bytes | None = None
    zstd_level: int = 3
    hash_landed: bool = True

    def __post_init__(self) -> None:
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"l2 compression must be one of {sorted(COMPRESSIONS)}")
        if self.key is not None and len(self.key) not in (16, 24, 32):
            raise ValueError("the L2 encryption key must be 16, 24 or 32 bytes")
        if self.compression == "zstd":
            _zstd()  # fail at start-up, naming the extra, not on the first write
        if self.key is not None:
            _aead()

    def __repr__(self) -> str:  # never show the key
        return f"Serde(compression={self.compression!r}, encrypted={self.key is not None})"

    @property
    def encrypted(self) -> bool:
        return self.key is not None

    def encode(self, key: str, payload: bytes | memoryview, checksum: int) -> bytes:
        """Blob for `payload` (whose kvsum64 is `checksum`) stored under `key` (CPU work: call from a
        worker thread)."""
        return b"".join(self.encode_parts(key, payload, checksum))

    def encode_parts(self, key: str, payload: bytes | memoryview, checksum: int) -> tuple[bytes, bytes | memoryview]:
        """(header, body) of the blob, uncopied: with no compression or encryption the body is
        `payload` itself, so a tier can write it with one `writev` (keep `payload` alive till then)."""
        comp, body = 0, payload
        if self.compression == "lz4":
            packed = lz4.block.compress(payload, store_size=False)
            comp, body = (1, packed) if len(packed) < len(payload) else (0, payload)
        elif self.compression == "zstd":
            packed = _zstd().ZstdCompressor(level=self.zstd_level).compress(payload)
            comp, body = (2, packed) if len(packed) < len(payload) else (0, payload)
        enc = ENC_AES_GCM if self.key is not None else ENC_NONE
        if self.key is not None:
            nonce = os.urandom(NONCE_BYTES)
            body = nonce + _aead().AESGCM(self.key).encrypt(nonce, bytes(body), _aad(key, comp, enc))
        head = HEADER.pack(MAGIC, VERSION, comp, enc, fingerprint(key), len(payload), len(body), checksum)
        return head + _checksum(head, body), body

    def verify_in_place(self, key: str, head: bytes | memoryview, body: memoryview) -> int | None:
        """A blob read as `head` (HEADER_BYTES) and `body` (straight into its destination): its
        kvsum64 when it is a plain object for `key` whose header checks out (and, with `hash_landed`,
        whose XXH3 matches), so `body` holds the payload; None when
        it is compressed, encrypted or of another version (decode `head + body` instead); raises
        CorruptObject or UndecryptableObject like `decode` (then `body` holds nothing usable)."""
        if len(head) != HEADER_BYTES:
            raise ValueError(f"the head of a blob is {HEADER_BYTES} bytes, not {len(head)}")
        fixed = bytes(head[: HEADER.size])
        magic, version, comp, enc, fp, payload_len, body_len, kvsum = HEADER.unpack(fixed)
        if magic != MAGIC:
            raise CorruptObject("bad magic")
        if version != VERSION or comp != 0 or enc != ENC_NONE:
            return None
        if body_len != len(body) or payload_len != len(body):
            raise CorruptObject(f"length mismatch: body has {len(body)} bytes, header says {body_len}/{payload_len}")
        if self.hash_landed and _checksum(fixed, body) != bytes(head[HEADER.size :]):
            raise CorruptObject("checksum mismatch")
        if fp != fingerprint(key):
            raise CorruptObject("key fingerprint mismatch (object stored under another key)")
        if self.key is not None:
            raise UndecryptableObject("plaintext object refused: this server requires encrypted L2 objects")
        return int(kvsum)

    def decode(self, key: str, blob: bytes | memoryview) -> bytes | memoryview:
        """The payload stored under `key`; raises CorruptObject or UndecryptableObject."""
        return self.decode_object(key, blob)[0]

    def decode_object(self, key: str, blob: bytes | memoryview) -> tuple[bytes | memoryview, int]:
        """(payload, its kvsum64 as the writer committed it); raises like `decode`."""
        view = memoryview(blob)
        if len(view) < HEADER.size:
            raise CorruptObject(f"truncated: {len(view)} bytes, shorter than the header")
        head = bytes(view[: HEADER.size])
        magic, version, comp, enc, fp, payload_len, body_len, kvsum = HEADER.unpack(head)
        if magic != MAGIC:
            raise CorruptObject("bad magic")
        if version not in DIGEST_BYTES:
            raise CorruptObject(f"unsupported blob version {version}")
        head_bytes = HEADER.size + DIGEST_BYTES[version]
        body = view[head_bytes:]
        if len(view) < head_bytes or len(body) != body_len:
            raise CorruptObject(f"truncated: body has {len(body)} bytes, header says {body_len}")
        if _checksum(head, body, version) != bytes(view[HEADER.size : head_bytes]):
            raise CorruptObject("checksum mismatch")
        if fp != fingerprint(key):
            raise CorruptObject("key fingerprint mismatch (object stored under another key)")
        if comp not in COMPRESSIONS.values() or enc not in (ENC_NONE, ENC_AES_GCM) or payload_len > MAX_PAYLOAD:
            raise CorruptObject("unknown compression or encryption, or absurd length")
        if enc == ENC_AES_GCM:
            if self.key is None:
                raise UndecryptableObject("object is encrypted and this server has no L2 key")
            if len(body) < NONCE_BYTES + TAG_BYTES:
                raise CorruptObject("encrypted body too short")
            aead = _aead()
            try:
                body = memoryview(
                    aead.AESGCM(self.key).decrypt(
                        bytes(body[:NONCE_BYTES]), bytes(body[NONCE_BYTES:]), _aad(key, comp, enc, version)
                    )
                )
            except aead.InvalidTag:
                raise UndecryptableObject("AES-GCM authentication failed (wrong key or moved object)") from None
        elif self.key is not None:
            raise UndecryptableObject("plaintext object refused: this server requires encrypted L2 objects")
        if comp == 1:
            try:
                out: bytes | memoryview = lz4.block.decompress(body, uncompressed_size=payload_len)
            except lz4.block.LZ4BlockError as exc:
                raise CorruptObject(f"lz4: {exc}") from None
        elif comp == 2:
            try:
                zstandard = _zstd()
            except ValueError as exc:  # intact, but this server cannot open it: a miss, kept
                raise UndecryptableObject(str(exc)) from None
            try:
                out = zstandard.ZstdDecompressor().decompress(body, max_output_size=payload_len)
            except zstandard.ZstdError as exc:
                raise CorruptObject(f"zstd: {exc}") from None
        else:
            out = body
        if len(out) != payload_len:
            raise CorruptObject(f"payload has {len(out)} bytes, header says {payload_len}")
        return out, kvsum


def _zstd() -> Any:
    return require("zstandard", "--l2-compression zstd")


class _Aead:
    """AES-GCM and its InvalidTag, imported on first use (cryptography is the `crypto` extra)."""

    def __init__(self) -> None:
        self.AESGCM = require("cryptography.hazmat.primitives.ciphers.aead", "L2 encryption").AESGCM
        self.InvalidTag = require("cryptography.exceptions", "L2 encryption").InvalidTag


_AEAD: list[_Aead] = []


def _aead() -> _Aead:
    if not _AEAD:
        _AEAD.append(_Aead())
    return _AEAD[0]


def _aad(key: str, comp: int, enc: int, version: int = VERSION) -> bytes:
    """Associated data: blob format, chain flags and the object key itself."""
    return MAGIC + bytes((version, comp, enc)) + key.encode()


def parse_key(text: str | bytes, *, source: str) -> bytes:
    """An AES key from hex (32/48/64 digits) or base64 text; from a file also 16/24/32 raw bytes.

    Text forms are tried first. Error messages name the source, never the key.
    """
    raw = text if isinstance(text, bytes) else text.encode()
    try:
        stripped = raw.strip().decode("ascii")
    except UnicodeDecodeError:
        stripped = ""
    for decode in (bytes.fromhex, lambda s: base64.b64decode(s, validate=True)):
        try:
            key = decode(stripped) if stripped else b""
        except (ValueError, binascii.Error):
            continue
        if len(key) in (16, 24, 32):
            return key
    if isinstance(text, bytes) and len(raw) in (16, 24, 32):
        return raw
    raise ValueError(f"L2 encryption key from {source} is not 16/24/32 bytes (hex, base64 or raw)")


def load_key(key_file: str | None, environ: Mapping[str, str] | None = None) -> bytes | None:
    """The configured key: `--l2-encryption-key-file` or the KVSERVER_L2_ENCRYPTION_KEY env var."""
    env_value = (environ if environ is not None else os.environ).get(KEY_ENV)
    if key_file and env_value:
        raise ValueError(f"give the L2 key either as a file or in {KEY_ENV}, not both")
    if key_file:
        try:
            with open(key_file, "rb") as fh:
                data = fh.read(4096)
        except OSError as exc:
            raise ValueError(f"cannot read the L2 key file {key_file}: {exc.strerror}") from None
        return parse_key(data, source=f"file {key_file}")
    if env_value:
        return parse_key(env_value, source=KEY_ENV)
    return None

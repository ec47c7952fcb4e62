"""Per-chunk extra keys of a vLLM request: what changes the KV of a chunk besides its tokens.

Why: two requests with the same token ids can have different KV. A LoRA adapter changes every
token's K/V; an image hides behind placeholder tokens whose ids are the same whatever the image.
vLLM folds such "extra keys" into its own block hashes (`generate_block_hash_extra_keys` in
vllm/v1/core/kv_cache_utils.py); we fold the same facts into our chunk hash chain, one 32-byte
digest per chunk that has any (kvprotocol `chunk_hashes(..., extra)`):

- LoRA: ("lora", adapter name, digest of the adapter's files) on every chunk. vLLM keys on name
  and path; we key on the files' content, so a re-trained adapter at the same path (or another
  process's copy of the same adapter) is told apart (or shared) by what it is, not where it lies.
- multimodal: ("mm", identifier, offset of the item relative to the chunk start) for every item
  whose placeholder range overlaps the chunk, in placeholder order (vLLM's rule, per chunk).
- prompt embeddings: never cached (`cacheable` is False): their KV depends on floats that are not
  in the token ids, and hashing megabytes of embeddings per request in the scheduler costs more
  than the reuse is worth for a path that is rarely shared. The connector then looks nothing up and
  saves nothing for the request (counted as `uncacheable_requests`).

Everything here is pure Python on duck-typed requests (no vLLM import), so it tests anywhere.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from blake3 import blake3

if TYPE_CHECKING:  # read by attribute: these functions take duck-typed requests in the tests
    from vllm.v1.request import Request

Part = tuple[str | int | bytes, ...]  # ("lora", name, digest), ("mm", identifier, offset), ...

_VERSION = b"kvserver-extra-v1"
_ADAPTER_READ = 1 << 20  # bytes read at a time while hashing adapter files


def _encode(parts: Sequence[Part]) -> bytes:
    """Unambiguous bytes for a list of (tag, str | int ...) tuples: length-prefixed, typed."""
    out = [_VERSION]
    for part in parts:
        out.append(struct.pack(">I", len(part)))
        for item in part:
            if isinstance(item, bool) or not isinstance(item, (str, int, bytes)):
                raise TypeError(f"extra key items are str, int or bytes, got {type(item).__name__}")
            if isinstance(item, int):
                out.append(b"i" + struct.pack(">q", item))
            else:
                raw = item.encode("utf-8") if isinstance(item, str) else item
                out.append((b"s" if isinstance(item, str) else b"b") + struct.pack(">I", len(raw)) + raw)
    return b"".join(out)


def digest_parts(parts: Sequence[Part]) -> bytes:
    """The 32-byte extra-key digest of one chunk's parts (see docs/protocol.md)."""
    return blake3(_encode(parts)).digest()


class AdapterDigests:
    """BLAKE3 over a LoRA adapter's files (relative names, sizes, contents), once per path.

    Content, not only metadata: two adapters trained from the same config have the same file
    names, sizes and safetensors headers. Adapters are small (MBs), and this runs once per adapter
    path per engine. A path that is not a readable local directory or file gives None: requests
    with that adapter are then not cached (we cannot say what they are).
    """

    def __init__(self) -> None:
        self._cache: dict[str, bytes | None] = {}
        self._lock = threading.Lock()

    def get(self, path: str) -> bytes | None:
        with self._lock:
            if path not in self._cache:
                self._cache[path] = _hash_adapter(path)
            return self._cache[path]


def _hash_adapter(path: str) -> bytes | None:
    try:
        if os.path.isfile(path):
            files = [(os.path.basename(path), path)]
        elif os.path.isdir(path):
            files = []
            for root, dirs, names in os.walk(path):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                for name in sorted(names):
                    full = os.path.join(root, name)
                    files.append((os.path.relpath(full, path).replace(os.sep, "/"), full))
            files.sort()
        else:
            return None
        if not files:
            return None
        h = blake3()
        h.update(_VERSION + b"/adapter")
        for rel, full in files:
            size = os.path.getsize(full)
            h.update(_encode([("file", rel, size)]))
            with open(full, "rb") as f:
                while block := f.read(_ADAPTER_READ):
                    h.update(block)
        return h.digest()
    except OSError:
        return None


@dataclass(frozen=True, slots=True)
class RequestKeys:
    """The extra keys of one request: `cacheable` False means never look up nor save it."""

    cacheable: bool
    extra: tuple[tuple[int, bytes], ...] = ()
    reason: str = ""


PLAIN = RequestKeys(True)


def _lora_part(request: Request, adapters: AdapterDigests) -> Part | bool | None:
    """("lora", name, digest), None without an adapter, False when the adapter cannot be named."""
    lora = getattr(request, "lora_request", None)
    if lora is None:
        return None
    path = getattr(lora, "lora_path", "") or getattr(lora, "path", "")
    digest = adapters.get(str(path)) if path else None
    if digest is None:
        return False
    return ("lora", str(lora.lora_name), digest)


def _mm_items(request: Request) -> list[tuple[str, int, int]] | None:
    """(identifier, placeholder offset, length) per multimodal item; None if one lacks an identifier."""
    items = []
    for feature in getattr(request, "mm_features", None) or ():
        ident = getattr(feature, "identifier", None) or getattr(feature, "mm_hash", None)
        pos = feature.mm_position
        if not ident:
            return None
        items.append((str(ident), int(pos.offset), int(pos.length)))
    items.sort(key=lambda it: it[1])
    return items


def request_keys(request: Request, num_tokens: int, chunk_size: int, adapters: AdapterDigests) -> RequestKeys:
    """Extra keys for the full chunks of the first num_tokens tokens of a vLLM `Request`."""
    if getattr(request, "prompt_embeds", None) is not None:
        return RequestKeys(False, (), "prompt_embeds")
    lora = _lora_part(request, adapters)
    if lora is False:
        return RequestKeys(False, (), "lora adapter files unreadable")
    items = _mm_items(request)
    if items is None:
        return RequestKeys(False, (), "multimodal item without identifier")
    if lora is None and not items:
        return PLAIN
    out: list[tuple[int, bytes]] = []
    for i in range(num_tokens // chunk_size):
        lo, hi = i * chunk_size, (i + 1) * chunk_size
        parts: list[Part] = [lora] if isinstance(lora, tuple) else []
        parts += [("mm", ident, off - lo) for ident, off, length in items if off < hi and off + length > lo]
        if parts:
            out.append((i, digest_parts(parts)))
    return RequestKeys(True, tuple(out))

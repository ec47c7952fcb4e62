"""The model part of cache keys: the served name plus a fingerprint of what makes the KV.

Why: the served name alone lets two different weights served under one name, or weights updated
in place with a persistent L2, serve each other's stale KV. The fingerprint, computed once at
connector start, covers the vLLM config that changes KV (model, revision, dtype, quantization,
KV cache dtype) and the weight files' metadata: names, sizes, safetensors headers, plus a few
small samples of each file's bytes (the headers of two checkpoints of one architecture are
identical; the samples tell their values apart without reading gigabytes). Only the header bytes
and the samples are read, never a whole file.

The fingerprint includes the model path, so engines that load the same weights from different
paths get different keys; such fleets set `model_id` (kv_connector_extra_config), which replaces
the fingerprint: the operator then vouches that every engine using that id computes the same KV.
"""

from __future__ import annotations

import json
import os
import struct
from typing import TYPE_CHECKING, BinaryIO

from blake3 import blake3

from .plan import model_key

if TYPE_CHECKING:
    from vllm.config import VllmConfig

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".msgpack", ".h5")
_SAMPLE = 64 << 10  # bytes per sample
_MAX_HEADER = 100 << 20  # safetensors caps its JSON header at 100 MB
_FP_HEX = 16


def _safetensors_header(f: BinaryIO, size: int) -> bytes:
    if size < 8:
        return b""
    (n,) = struct.unpack("<Q", f.read(8))
    if n > min(_MAX_HEADER, size - 8):
        return b""
    return f.read(n)


def _file_entry(path: str, rel: str) -> bytes:
    """name, size, safetensors header (if any) and three samples of one weight file."""
    size = os.path.getsize(path)
    h = blake3()
    h.update(json.dumps([rel, size]).encode())
    with open(path, "rb") as f:
        header = _safetensors_header(f, size) if rel.endswith(".safetensors") else b""
        h.update(struct.pack(">Q", len(header)) + header)
        for pos in sorted({0, max(0, size // 2 - _SAMPLE // 2), max(0, size - _SAMPLE)}):
            f.seek(pos)
            h.update(f.read(_SAMPLE))
    return h.digest()


def weight_files(model: str) -> list[tuple[str, str]]:
    """(relative name, path) of the weight files of a local model directory or file, sorted."""
    if os.path.isfile(model):
        return [(os.path.basename(model), model)]
    if not os.path.isdir(model):
        return []
    out = []
    for root, dirs, names in os.walk(model):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in names:
            if name.endswith(WEIGHT_SUFFIXES) or name == "config.json":
                full = os.path.join(root, name)
                out.append((os.path.relpath(full, model).replace(os.sep, "/"), full))
    return sorted(out)


def config_parts(vllm_config: VllmConfig) -> dict[str, str]:
    """The parts of vLLM's config that change the KV of a token sequence, as strings."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    return {
        "model": str(mc.model),
        "revision": str(getattr(mc, "revision", None)),
        "dtype": str(getattr(mc, "dtype", None)),
        "quantization": str(getattr(mc, "quantization", None)),
        "kv_cache_dtype": str(getattr(cc, "cache_dtype", None)),
    }


def model_fingerprint(parts: dict[str, str], model_path: str, model_id: str | None = None) -> tuple[str, int]:
    """16 hex chars over the config parts and the weight files; also how many files were read.

    With model_id, it stands for the model path and the weights (no file is read); the other
    config parts (dtype, quantization, KV cache dtype) still count.
    """
    h = blake3()
    if model_id is not None:
        parts = {**parts, "model": "", "model_id": model_id}
    h.update(b"kvserver-model-v1" + json.dumps(parts, sort_keys=True).encode())
    files = [] if model_id is not None else weight_files(model_path)
    for rel, full in files:
        h.update(_file_entry(full, rel))
    return h.hexdigest()[:_FP_HEX], len(files)


def model_key_with_fingerprint(name: str, fingerprint: str) -> str:
    """`<name>@<fingerprint>`, a valid kvprotocol model name (at most 200 chars)."""
    return f"{model_key(name)[: 199 - len(fingerprint)]}@{fingerprint}"

"""What the vLLM connector folds into keys, without an engine: adapter digests, request extra keys,
the model fingerprint (pure modules: no vLLM import)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from kvconnector.vllm import config
from kvconnector.vllm.extra_keys import AdapterDigests, request_keys
from kvconnector.vllm.fingerprint import model_fingerprint, model_key_with_fingerprint
from kvprotocol import validate_model

PARTS = {"model": "/m", "revision": "None", "dtype": "torch.float32", "quantization": "None", "kv_cache_dtype": "auto"}


def _safetensors(path: Path, seed: int, n: int = 300_000) -> None:
    data = np.random.default_rng(seed).standard_normal(n).astype(np.float32).tobytes()
    header = json.dumps({"w": {"dtype": "F32", "shape": [n], "data_offsets": [0, len(data)]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def _model(d: Path, seed: int) -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text('{"hidden_size": 128}')
    _safetensors(d / "model.safetensors", seed)
    return d


def test_fingerprint_tells_weights_apart_and_model_id_spans_paths(tmp_path: Path) -> None:
    a, b = _model(tmp_path / "a", 1), _model(tmp_path / "b", 2)
    fa, files = model_fingerprint(PARTS, str(a))
    assert files == 2
    assert model_fingerprint(PARTS, str(b))[0] != fa  # same header and size, other values
    assert model_fingerprint(PARTS, str(a))[0] == fa  # stable
    _safetensors(a / "model.safetensors", 2)  # weights updated in place
    assert model_fingerprint(PARTS, str(a))[0] != fa
    assert model_fingerprint({**PARTS, "kv_cache_dtype": "fp8"}, str(a))[0] != model_fingerprint(PARTS, str(a))[0]
    fid = model_fingerprint({**PARTS, "model": "/x"}, str(a), "llama-8b-v3")[0]
    assert fid == model_fingerprint({**PARTS, "model": "/y"}, str(b), "llama-8b-v3")[0]
    assert fid != model_fingerprint({**PARTS, "dtype": "torch.bfloat16"}, str(a), "llama-8b-v3")[0]
    key = model_key_with_fingerprint("x" * 300, fa)
    assert validate_model(key) == key and key.endswith("@" + fa) and len(key) == 200


def test_adapter_digest_is_content_and_cached(tmp_path: Path) -> None:
    for name, seed in (("a", 1), ("b", 2)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text('{"r": 8}')
        _safetensors(tmp_path / name / "adapter_model.safetensors", seed, 5000)
    digests = AdapterDigests()
    da, db = digests.get(str(tmp_path / "a")), digests.get(str(tmp_path / "b"))
    assert da is not None and db is not None and da != db
    _safetensors(tmp_path / "a" / "adapter_model.safetensors", 2, 5000)
    assert digests.get(str(tmp_path / "a")) == da  # once per path per engine, like vLLM's adapter cache
    assert AdapterDigests().get(str(tmp_path / "a")) == db  # content, not path
    assert digests.get(str(tmp_path / "missing")) is None


def _req(**kw):
    return SimpleNamespace(**{"lora_request": None, "mm_features": None, "prompt_embeds": None, **kw})


def test_request_keys(tmp_path: Path) -> None:
    digests = AdapterDigests()
    assert request_keys(_req(), 1000, 256, digests).extra == ()
    assert not request_keys(_req(prompt_embeds=[0.0]), 1000, 256, digests).cacheable
    gone = SimpleNamespace(lora_name="x", lora_path=str(tmp_path / "gone"))
    assert not request_keys(_req(lora_request=gone), 1000, 256, digests).cacheable  # cannot say what it is
    img = SimpleNamespace(identifier="h", mm_position=SimpleNamespace(offset=250, length=10))
    keys = request_keys(_req(mm_features=[img]), 1000, 256, digests)
    assert [i for i, _ in keys.extra] == [0, 1]  # [250, 260) overlaps chunks 0 and 1
    nameless = SimpleNamespace(identifier="", mm_position=SimpleNamespace(offset=0, length=4))
    assert not request_keys(_req(mm_features=[nameless]), 1000, 256, digests).cacheable


def test_model_id_option() -> None:
    assert config.parse_config({"model_id": "fleet-llama@v3"}).model_id == "fleet-llama@v3"
    with pytest.raises(ValueError):
        config.parse_config({"model_id": ""})
    assert config.parse_config({"debug_fail_plan_loads": True}).debug_fail_plan_loads is True
    with pytest.raises(ValueError):
        config.parse_config({"chunk_size": True})  # bools are not ints

"""EC keys: the KV cache dtype never changes them, the model dtype and weights do; ranks fold away."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from kvconnector.vllm.ec_keys import ec_item, ec_model_and_space
from kvprotocol._ec_messages import validate_item


def config(model: str, dtype: str = "float32", kv_dtype: str = "auto", tp: int = 1) -> SimpleNamespace:
    """The few vLLM config fields the key reads (vLLM's own VllmConfig carries them under these names)."""
    return SimpleNamespace(
        model_config=SimpleNamespace(
            model=model, revision=None, dtype=dtype, quantization=None, served_model_name=None
        ),
        cache_config=SimpleNamespace(cache_dtype=kv_dtype),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp),
    )


def test_ec_identity(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 64)
    base = ec_model_and_space(config(str(tmp_path)), None, None)
    assert ec_model_and_space(config(str(tmp_path), kv_dtype="fp8"), None, None) == base  # KV quantisation
    assert ec_model_and_space(config(str(tmp_path), tp=4), None, None) == base  # one object for every rank
    other_dtype = ec_model_and_space(config(str(tmp_path), dtype="bfloat16"), None, None)
    assert other_dtype[1] != base[1]
    (tmp_path / "model.safetensors").write_bytes(b"\1" * 64)  # other weights: another model key
    assert ec_model_and_space(config(str(tmp_path)), None, None)[0] != base[0]


def test_items_are_always_valid_protocol_items() -> None:
    assert ec_item("9f86d081884c7d659a2feaa0c55ad015") == "9f86d081884c7d659a2feaa0c55ad015"
    odd = ec_item("user uuid with spaces/and ünïcode")
    assert odd.startswith("h:") and validate_item(odd) == odd
    assert ec_item("x" * 300) != ec_item("x" * 301)

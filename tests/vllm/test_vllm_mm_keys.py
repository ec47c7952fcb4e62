"""Multimodal and LoRA extra keys derived from real vLLM `Request` objects (vLLM's own classes:
Request, MultiModalFeatureSpec, PlaceholderRange, LoRARequest), checked against vLLM's own
per-block extra keys (`generate_block_hash_extra_keys`) over the same token ranges.

A real multimodal engine runs in test_vllm_multimodal.py; this checks the derivation case by case.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from kvtestkit.engines.vllm_harness import VLLM_PYTHON, build_adapter, engine_env

pytestmark = pytest.mark.vllm_engine
PROBE = Path(__file__).resolve().parent / "mm_keys_probe.py"


@pytest.fixture(scope="module")
def probe(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    adapter = build_adapter(tmp_path_factory.mktemp("lora") / "adapter", model_dir, seed=3)
    proc = subprocess.run(
        [str(VLLM_PYTHON), str(PROBE), str(adapter)],
        capture_output=True,
        text=True,
        timeout=300,
        env=engine_env(adapter.parent / "vllm-cache"),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_keys_follow_vllms_own_extra_keys(probe: dict) -> None:
    for name, case in probe.items():
        if "from_vllm" in case:
            assert case["extra"] == case["from_vllm"], name


def test_images_behind_the_same_placeholders_get_different_keys(probe: dict) -> None:
    plain, a, b, moved = (probe[k]["hashes"] for k in ("plain", "img_a", "img_b", "img_a_moved"))
    assert [i for i, _ in probe["img_a"]["extra"]] == [1]  # [300, 364) lies in chunk 1 only
    assert a[0] == b[0] == plain[0]  # chunk 0 holds no image: shared
    assert a[1] != b[1] and a[2] != b[2]  # another image: chunk 1 and everything after differ
    assert moved[1] not in (a[1], b[1])  # the same image elsewhere is another KV
    assert [i for i, _ in probe["two_images"]["extra"]] == [0, 1, 2]  # img-b spans chunks 1-2


def test_lora_keys_every_chunk_and_embeddings_are_never_cached(probe: dict) -> None:
    assert [i for i, _ in probe["lora"]["extra"]] == [0, 1, 2]
    assert probe["lora"]["hashes"][0] != probe["plain"]["hashes"][0]
    assert probe["lora_img"]["hashes"][1] not in (probe["lora"]["hashes"][1], probe["img_a"]["hashes"][1])
    assert all(probe[k]["cacheable"] for k in probe if k != "prompt_embeds")
    assert probe["prompt_embeds"]["cacheable"] is False

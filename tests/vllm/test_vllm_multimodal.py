"""Two images behind the same placeholder tokens never share KV (real vLLM, a tiny random Idefics3).

The prompt's text is the same; only the image differs, and its placeholder token ids are the same
whatever the image. Chunk 0 (text only) is shared; chunk 1 (holding the image) is not.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtestkit.serverproc import ServerFactory
from vllm_cases import MAX_TOKENS, kv_config
from kvtestkit.engines.vllm_harness import build_vlm, run_engine

pytestmark = pytest.mark.vllm_engine

VLM = {"skip_tokenizer_init": False, "limit_mm_per_prompt": {"image": 1}, "enable_prefix_caching": False}


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vlm(tmp_path_factory.mktemp("tiny-vlm") / "model")


def test_images_behind_the_same_placeholders_never_share_kv(vlm_dir: Path, kvserver_factory: ServerFactory) -> None:

    from kvtestkit.engines.tiny_vlm import words

    # Chunks of 64 tokens keep the prompt short, so that 16 image tokens visibly change the output:
    # chunk 0 is text only, the image's placeholders lie in chunk 1, the prompt holds 2 full chunks.
    text = words(90, 1) + " <image> " + words(25, 2)
    a, b = {"text": text, "image_seed": 1}, {"text": text, "image_seed": 2}
    base = run_engine(vlm_dir, [[a], [b]], max_tokens=MAX_TOKENS, llm_kwargs=VLM)
    want_a, want_b = (r.token_ids for r in base.requests)
    assert want_a != want_b  # the image changes the output
    assert 128 <= base.requests[0].prompt_len < 192

    server = kvserver_factory("--chunk-size", "64")
    run = run_engine(
        vlm_dir,
        [[a], [b], [a], [b]],
        max_tokens=MAX_TOKENS,
        kv_transfer_config=kv_config(server.url, chunk_size=64),
        llm_kwargs=VLM,
    )
    _, first_b, again_a, again_b = run.requests
    kv = [r.kv_transfer_params["kvserver"] for r in run.requests]
    assert kv[0]["hit_tokens"] == 0 and 0 <= kv[0]["stored_tokens"] <= 128  # confirmed by finish
    assert kv[1]["hit_tokens"] == 64  # the text-only chunk 0 is shared; the image's chunk is not
    assert first_b.connector_loaded_tokens == 64
    assert again_a.connector_loaded_tokens == 128 and again_b.connector_loaded_tokens == 128
    assert [r.token_ids for r in run.requests] == [want_a, want_b, want_a, want_b]

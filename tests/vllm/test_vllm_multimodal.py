"""Two images behind the same placeholder tokens never share KV (real vLLM, a tiny random Idefics3).

The prompt's text is the same; only the image differs, and its placeholder token ids are the same
whatever the image. Chunk 0 (text only) is shared; chunk 1 (holding the image) is not.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserver_proc import ServerFactory
from vllm_cases import MAX_TOKENS, kv_config
from vllm_harness import build_vlm, run_engine

pytestmark = pytest.mark.vllm_engine

VLM = {"skip_tokenizer_init": False, "limit_mm_per_prompt": {"image": 1}, "enable_prefix_caching": False}


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vlm(tmp_path_factory.mktemp("tiny-vlm") / "model")


def test_images_behind_the_same_placeholders_never_share_kv(vlm_dir: Path, kvserver_factory: ServerFactory) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from tiny_vlm import words

    text = words(300, 1) + " <image> " + words(260, 2)  # the image's placeholders lie in chunk 1
    a, b = {"text": text, "image_seed": 1}, {"text": text, "image_seed": 2}
    base = run_engine(vlm_dir, [[a], [b]], max_tokens=MAX_TOKENS, llm_kwargs=VLM)
    want_a, want_b = (r.token_ids for r in base.requests)
    assert want_a != want_b  # the image changes the output
    assert base.requests[0].prompt_len >= 512

    server = kvserver_factory()
    run = run_engine(vlm_dir, [[a], [b], [a], [b]], max_tokens=MAX_TOKENS, kv_transfer_config=kv_config(server.url),
                     llm_kwargs=VLM)
    first_a, first_b, again_a, again_b = run.requests
    kv = [r.kv_transfer_params["kvserver"] for r in run.requests]
    assert kv[0]["hit_tokens"] == 0 and kv[0]["stored_tokens"] == 512
    assert kv[1]["hit_tokens"] == 256  # the text-only chunk 0 is shared; the image's chunk is not
    assert first_b.connector_loaded_tokens == 256
    assert again_a.connector_loaded_tokens == 512 and again_b.connector_loaded_tokens == 512
    assert [r.token_ids for r in run.requests] == [want_a, want_b, want_a, want_b]

"""The encoder cache with real vLLM engines (a tiny random Idefics3 on vLLM CPU, docs/multimodal.md).

One kvserver; engines in separate processes, in this order:
  base  no connector: the reference tokens of image a and image b (same text, same placeholders)
  e1    EC + KV connectors, image a: encodes a, stores its encoder output and its KV
  e2    EC + KV, image b: the text-only KV chunk is shared, the image chunk is not, and the encoder
        output of a is never served for b: b is encoded (and stored)
  e3    EC only, images a then b: both encoder outputs are loaded, the vision tower never runs,
        and each image gives its own reference tokens
  e4    EC only, every promised load fails (fault injection): the runner encodes instead, same tokens
The encoder runs are counted inside the engine (each output vLLM's model runner computes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvprotocol import Client
from kvtestkit.serverproc import ServerFactory
from vllm_cases import MAX_TOKENS, kv_config
from test_vllm_tp import _remove_vllm_dist_segments  # noqa: F401 - autouse: cleans up after the TP run
from kvtestkit.engines.vllm_harness import build_vlm, run_engine

pytestmark = [pytest.mark.vllm_engine, pytest.mark.timeout(1200)]  # several engines, ~20-140 s each

VLM = {"skip_tokenizer_init": False, "limit_mm_per_prompt": {"image": 1}, "enable_prefix_caching": False}
COUNT = {"count_encoder": True}


def ec_config(url: str, **extra: Any) -> dict[str, Any]:
    return {
        "ec_connector": "KVServerECConnector",
        "ec_connector_module_path": "kvconnector.vllm",
        "ec_role": "ec_both",
        "ec_connector_extra_config": {"kvserver_url": url, **extra},
    }


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vlm(tmp_path_factory.mktemp("tiny-vlm-ec") / "model")


def test_second_engine_skips_the_encoder_and_images_never_share(vlm_dir: Path, kvserver_factory: ServerFactory) -> None:
    from kvtestkit.engines.tiny_vlm import words

    text = words(90, 1) + " <image> " + words(25, 2)  # chunk 0 (64 tokens) text only, the image in chunk 1
    a, b = {"text": text, "image_seed": 1}, {"text": text, "image_seed": 2}
    base = run_engine(vlm_dir, [[a], [b]], max_tokens=MAX_TOKENS, llm_kwargs=VLM, extra_spec=COUNT)
    want_a, want_b = (r.token_ids for r in base.requests)
    assert want_a != want_b  # the image changes the output
    assert [x.encoder_runs for x in base.batches] == [1, 1]

    server = kvserver_factory("--chunk-size", "64", "--ec-size-gb", "0.0625")
    ec = {**COUNT, "ec_transfer_config": ec_config(server.url)}
    both: dict[str, Any] = {
        "kv_transfer_config": kv_config(server.url, chunk_size=64),
        "llm_kwargs": VLM,
        "extra_spec": ec,
    }
    e1 = run_engine(vlm_dir, [[a]], max_tokens=MAX_TOKENS, **both)
    assert e1.requests[0].token_ids == want_a
    assert e1.batches[0].encoder_runs == 1 and e1.batches[0].ec["saves"] == 1

    e2 = run_engine(vlm_dir, [[b]], max_tokens=MAX_TOKENS, **both)
    assert e2.requests[0].kv_transfer_params["kvserver"]["hit_tokens"] == 64  # text chunk shared, image chunk not
    assert e2.batches[0].encoder_runs == 1 and e2.batches[0].ec["loads"] == 0  # a's output never served for b
    assert e2.requests[0].token_ids == want_b

    with Client(server.url) as c:
        desc = c.call("describe").result["ec"]
    assert desc["objects"] == 2 and desc["counters"]["stores"] == 2

    e3 = run_engine(
        vlm_dir, [[a], [b]], max_tokens=MAX_TOKENS, llm_kwargs=VLM, extra_spec={**ec, "connector_stats": True}
    )
    assert [x.encoder_runs for x in e3.batches] == [0, 0]  # the vision tower never ran
    for batch in e3.batches:  # what vLLM's own stats path (SchedulerStats.ec_connector_stats) saw
        assert batch.connector_stats is not None
        assert batch.connector_stats["ec_hits"] == 1 and batch.connector_stats["ec_loads_planned"] == 1
    assert e3.batches[-1].ec["loads"] == 2 and e3.batches[-1].ec["bad_checksums"] == 0
    assert [r.token_ids for r in e3.requests] == [want_a, want_b]

    failing = {**COUNT, "ec_transfer_config": ec_config(server.url, debug_fail_loads=True)}
    e4 = run_engine(vlm_dir, [[a]], max_tokens=MAX_TOKENS, llm_kwargs=VLM, extra_spec=failing)
    assert e4.batches[0].encoder_runs == 1 and e4.batches[0].ec["encoded_instead"] == 1
    assert e4.requests[0].token_ids == want_a


def test_tp2_ranks_store_once_and_both_load(vlm_dir: Path, kvserver_factory: ServerFactory, tmp_path: Path) -> None:
    """TP ranks compute bit-identical encoder outputs: rank 0 stores one object, every rank loads it,
    and the engine that loaded gives the tokens of the engine that encoded."""
    from test_vllm_tp import TP, tp_env
    from kvtestkit.engines.tiny_vlm import words

    a = {"text": words(90, 1) + " <image> " + words(25, 2), "image_seed": 1}
    env = tp_env(tmp_path)
    server = kvserver_factory("--ec-size-gb", "0.0625")
    spec = {"ec_transfer_config": ec_config(server.url)}
    first = run_engine(vlm_dir, [[a]], max_tokens=MAX_TOKENS, env=env, llm_kwargs={**VLM, **TP}, extra_spec=spec)
    with Client(server.url) as c:
        ec = c.call("describe").result["ec"]
    assert ec["objects"] == 1 and ec["counters"]["stores"] == 1
    assert ec["counters"]["deduplicated"] == 0  # rank 1 never tried to store its identical copy
    second = run_engine(vlm_dir, [[a]], max_tokens=MAX_TOKENS, env=env, llm_kwargs={**VLM, **TP}, extra_spec=spec)
    assert second.requests[0].token_ids == first.requests[0].token_ids
    with Client(server.url) as c:
        ec = c.call("describe").result["ec"]
    # rank 0 did not encode (it would have tried to store again: deduplicated), both ranks read
    # under one lease of two readers and gave it back
    assert ec["counters"]["stores"] == 1 and ec["counters"]["deduplicated"] == 0
    assert ec["counters"]["hits"] >= 1 and ec["leases"] == 0 and ec["counters"]["expired_leases"] == 0

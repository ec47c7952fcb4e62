"""The connector's token arithmetic and config parsing (pure functions, no engine)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvconnector.vllm import config, plan


def test_usable_hit_leaves_one_token_to_compute() -> None:
    assert plan.usable_hit(512, 700, 0) == 512
    assert plan.usable_hit(512, 512, 0) == 511  # the whole prompt is cached: vLLM still computes one
    assert plan.usable_hit(512, 700, 480) == 32  # vLLM's own prefix cache holds the first 480
    assert plan.usable_hit(256, 700, 480) == 0  # ... which covers more than the server's hit
    assert plan.usable_hit(0, 700, 0) == 0


@given(
    hit_chunks=st.integers(0, 16),
    n=st.integers(1, 5000),
    local_blocks=st.integers(0, 160),
    chunk_mult=st.sampled_from([1, 2, 4, 8]),
    block=st.sampled_from([32, 64]),
)
def test_load_range_is_within_the_hit_and_the_request(
    hit_chunks: int, n: int, local_blocks: int, chunk_mult: int, block: int
) -> None:
    chunk = block * chunk_mult
    hit = min(hit_chunks * chunk, plan.floor_to(n, chunk))
    local = min(local_blocks * block, plan.floor_to(n - 1, block))
    ext = plan.usable_hit(hit, n, local)
    assert ext >= 0 and local + ext <= n - 1
    if ext:
        end = plan.load_end(local, ext, chunk)
        assert end % chunk == 0 and local + ext <= end <= hit <= n


def test_save_end_stores_each_full_chunk_once() -> None:
    assert plan.save_end(0, 255, 1000, 256) is None
    assert plan.save_end(0, 700, 1000, 256) == 512
    assert plan.save_end(512, 700, 1000, 256) is None
    assert plan.save_end(512, 800, 1000, 256) == 768
    assert plan.save_end(0, 2000, 600, 256) == 512  # the policy limit (prompt length) caps it


def test_key_salt_hides_and_separates_salts() -> None:
    assert plan.key_salt(None) == plan.key_salt("") == ""
    a, b = plan.key_salt("tenant a!"), plan.key_salt("tenant b!")
    assert a != b and "tenant" not in a
    from kvprotocol import validate_salt

    validate_salt(a)


@pytest.mark.parametrize(
    "name,want", [("/tmp/x/model", "tmp/x/model"), ("meta-llama/Llama-3-8B", "meta-llama/Llama-3-8B"), ("a b", "a_b")]
)
def test_model_key_is_a_valid_model_name(name: str, want: str) -> None:
    from kvprotocol import validate_model

    assert plan.model_key(name) == want
    validate_model(plan.model_key(name))
    validate_model(plan.model_key("/" * 5))
    validate_model(plan.model_key("x" * 500))


def test_config_defaults_and_errors() -> None:
    cfg = config.parse_config({})
    assert cfg.kvserver_url == "tcp://127.0.0.1:5555" and cfg.mode == "auto" and cfg.chunk_size == 256
    assert cfg.async_loads and cfg.async_saves and cfg.plan_loads and cfg.lookup_wait_s == 0.002
    assert config.parse_config({"mode": "tcp", "timeout_s": 2, "save_policy": "all"}).timeout_s == 2
    assert config.parse_config({"lookup_wait_s": 0}).lookup_wait_s == 0
    assert (cfg.lookup_wait_step_share, cfg.lookup_wait_max_s, cfg.lookup_miss_reuse_s) == (0.1, 0.02, 0.5)
    assert cfg.lookup_hit_reuse_s == 0.5 and cfg.in_step_load_share == 1.0 and cfg.lookup_wait_idle_s == 0.1
    for bad in (
        {"mdoe": "tcp"},
        {"mode": "udp"},
        {"save_policy": "sometimes"},
        {"timeout_s": 0},
        {"lookup_wait_s": -0.1},
        {"lookup_wait_s": 2},
        {"lookup_wait_s": "1"},
        {"lookup_wait_step_share": 1.5},
        {"lookup_wait_max_s": -1},
        {"lookup_wait_idle_s": 1.5},
        {"lookup_miss_reuse_s": 61},
        {"lookup_hit_reuse_s": 6},
        {"in_step_load_share": -0.1},
        {"in_step_load_share": 101},
        {"kvserver_url": "http://x"},
        {"chunk_size": "256"},
        {"debug_fail_load_chunks": [-1]},
    ):
        with pytest.raises(ValueError):
            config.parse_config(bad)
    cfg.check_block_size(32)
    with pytest.raises(ValueError, match="multiple"):
        config.parse_config({"chunk_size": 100}).check_block_size(32)


def test_server_url_falls_back_to_the_environment() -> None:
    env = {"KVSERVER_URL": "tcp://10.1.2.3:5555"}
    assert config.parse_config({}, env).kvserver_url == "tcp://10.1.2.3:5555"
    assert config.parse_config({"kvserver_url": "tcp://127.0.0.1:6000"}, env).kvserver_url == "tcp://127.0.0.1:6000"
    assert config.parse_config({}, {}).kvserver_url == config.DEFAULT_URL
    with pytest.raises(ValueError, match="tcp:// or ipc://"):
        config.parse_config({}, {"KVSERVER_URL": "10.1.2.3:5555"})


def test_roles_select_loading_and_saving() -> None:
    cfg = config.parse_config({})
    both = cfg.apply_role(is_producer=True, is_consumer=True)
    assert both.load and both.save_policy == "all" and not both.reserve  # the default: answers too
    producer = cfg.apply_role(is_producer=True, is_consumer=False)
    # a producer reserves its prompts' chunks: it stores prompts only
    assert not producer.load and producer.reserve and producer.save_policy == "prompt"
    unreserved = config.parse_config({"reserve": False}).apply_role(is_producer=True, is_consumer=False)
    assert not unreserved.reserve and unreserved.save_policy == "all"
    kept = config.parse_config({"save_policy": "prompt"}).apply_role(is_producer=True, is_consumer=True)
    assert kept.save_policy == "prompt"
    consumer = cfg.apply_role(is_producer=False, is_consumer=True)
    assert consumer.load and consumer.save_policy == "none"
    with pytest.raises(ValueError):
        config.parse_config({"load": False})  # derived from kv_role, not a user key

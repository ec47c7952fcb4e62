"""Runs ONE vLLM engine in this process and writes what it generated as JSON.

Meant to be executed as a script by the .venv-vllm interpreter in a fresh subprocess (see
`vllm_harness.run_engine`): vLLM keeps process-global state (the KV connector agent, the
distributed groups), so every engine gets its own process.

    python engine_runner.py SPEC.json RESULT.json

SPEC: {"model": dir, "block_size": 32, "max_model_len": 2048, "max_tokens": 8,
       "kv_transfer_config": {...} | null, "llm_kwargs": {...},
       "batches": [[{"prompt_token_ids": [...], "cache_salt": "..."?}, ...], ...]}
Each batch is one `LLM.generate` call, timed on its own. A prompt may instead be a later turn of
an earlier request of this engine: {"extend": [batch, index], "append": [...]} means that request's
prompt + its generated tokens + append (a multi-turn chat). RESULT: {"init_s", "batches":
[{"wall_s", "requests": [{"prompt_len", "token_ids", "num_cached_tokens", "kv_transfer_params"}]}]}.

Optional SPEC keys: "gates": {"<batch index>": path} waits (up to 120 s) for that file before the
batch, so a test can change the world (start a server) between two batches of one engine;
"force_async_scheduling": true turns vLLM's async scheduling back on after the CPU platform
turned it off (RESULT's "async_scheduling" says what the engine ran with); a prompt may carry
"lora": [name, int id, adapter dir], or be {"text", "image_seed"} for the tiny_vlm model;
"connector_stats": true sums, per batch, the KV (and EC) connector stats that vLLM's scheduler routes into
its SchedulerStats (the `get_kv_connector_stats` hook) into RESULT's batches[i]["connector_stats"], and
puts the connector's `vllm:kvserver_*` counters from vLLM's Prometheus registry into RESULT["prometheus"];
"ec_transfer_config" sets vLLM's encoder-cache connector; "count_encoder": true counts, per batch, the
encoder outputs the model runner computed (each call of its `_cache_encoder_output`, in-process) into
batches[i]["encoder_runs"], and the EC connector's worker-side counters into batches[i]["ec"].
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def _capture_connector_stats(llm: Any) -> dict[str, float]:
    """Sum what the scheduler puts into SchedulerStats.kv_connector_stats (in-process engine core)."""
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    totals: dict[str, float] = {}
    make_stats = sched.make_stats

    def capture(*args: Any, **kwargs: Any) -> Any:
        stats = make_stats(*args, **kwargs)
        payload = {
            **(getattr(stats, "kv_connector_stats", None) or {}),
            **(getattr(stats, "ec_connector_stats", None) or {}),
        }
        for name, value in payload.items():
            if isinstance(value, (int, float)):
                totals[name] = totals.get(name, 0) + value
        return stats

    sched.make_stats = capture
    return totals


def _count_encoder_runs() -> list[int]:
    """TEST ONLY: count encoder outputs computed by vLLM's model runner (one call per encoded item)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runs = [0]
    original = GPUModelRunner._cache_encoder_output

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        runs[0] += 1
        return original(self, *args, **kwargs)

    GPUModelRunner._cache_encoder_output = counting  # type: ignore[method-assign]
    return runs


def _ec_stats() -> dict[str, Any]:
    """The worker-side EC connector's counters (the worker runs in this process)."""
    from vllm.distributed.ec_transfer import get_ec_transfer, has_ec_transfer

    if not has_ec_transfer():
        return {}
    conn = get_ec_transfer()
    stats = dict(vars(conn.client.stats)) if hasattr(conn, "client") else {}
    stats["encoded_instead"] = getattr(conn, "encoded_instead", 0)
    return stats


def _wait_for(path: str, timeout: float = 120.0) -> None:
    open(path + ".waiting", "w").close()  # tells the test this engine reached the gate
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"gate {path} never opened")
        time.sleep(0.05)


def _force_async_scheduling() -> None:
    """TEST ONLY: vLLM's CPU platform turns async scheduling off in check_and_update_config ("not
    required on CPU"); turn it back on after that hook, to run the connector under async scheduling."""
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def patched(cls: Any, vllm_config: Any) -> None:
        original(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    CpuPlatform.check_and_update_config = classmethod(patched)  # type: ignore[method-assign]


def drain(llm: Any, timeout: float = 120.0) -> None:
    """Step the engine until the connector's background work of the batch has ended.

    LLM.generate returns once every output is complete; a request whose asynchronous saves still
    run keeps its blocks until the connector reports it "finished sending" from a later step. A
    server's engine loop keeps stepping for it; offline, the next generate would. Stepping here
    (as the server would) ends each batch with its saves done and their counters in its stats.
    """
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    deadline = time.monotonic() + timeout
    while sched.has_requests():
        if time.monotonic() > deadline:
            raise TimeoutError("the connector's background work did not end")
        llm.llm_engine.step()
        time.sleep(0.002)


def _lora(p: dict[str, Any]) -> Any:
    if not p.get("lora"):
        return None
    from vllm.lora.request import LoRARequest

    name, int_id, path = p["lora"]
    return LoRARequest(name, int_id, path)


def _run(spec: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    if spec.get("force_async_scheduling"):
        _force_async_scheduling()
    from vllm import LLM, SamplingParams

    kwargs: dict[str, Any] = dict(
        model=spec["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        distributed_executor_backend="uni",
        max_model_len=spec.get("max_model_len", 2048),
        block_size=spec.get("block_size", 32),
        dtype="float32",
        seed=0,
    )
    if spec.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = spec["kv_transfer_config"]
    if spec.get("ec_transfer_config"):
        kwargs["ec_transfer_config"] = spec["ec_transfer_config"]
    encoder_runs = _count_encoder_runs() if spec.get("count_encoder") else None
    kwargs.update(spec.get("llm_kwargs", {}))
    if spec.get("connector_stats"):
        kwargs["disable_log_stats"] = False
    llm = LLM(**kwargs)
    init_s = time.perf_counter() - t0
    async_on = bool(llm.llm_engine.vllm_config.scheduler_config.async_scheduling)
    totals = _capture_connector_stats(llm) if spec.get("connector_stats") else None
    gates: dict[str, str] = spec.get("gates", {})

    params = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 8), ignore_eos=True, detokenize=False)
    batches: list[dict[str, Any]] = []
    sent: list[list[list[int]]] = []  # the prompt of every request so far, for "extend"
    for index, batch in enumerate(spec["batches"]):
        if str(index) in gates:
            _wait_for(gates[str(index)])
        if totals is not None:
            totals.clear()
        prompts = []
        loras = []
        for p in batch:
            loras.append(_lora(p))
            if "extend" in p:
                b, i = p["extend"]
                ids = sent[b][i] + batches[b]["requests"][i]["token_ids"] + list(p.get("append", []))
            elif "text" in p:  # a tiny_vlm prompt: text with one <image>, the image drawn from a seed
                from kvtestkit.engines.tiny_vlm import image

                prompts.append({"prompt": p["text"], "multi_modal_data": {"image": image(p["image_seed"])}})
                continue
            else:
                ids = list(p["prompt_token_ids"])
            prompt: dict[str, Any] = {"prompt_token_ids": ids}
            if p.get("cache_salt") is not None:
                prompt["cache_salt"] = p["cache_salt"]
            prompts.append(prompt)
        t = time.perf_counter()
        lora_arg = loras if any(x is not None for x in loras) else None
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_arg)
        wall = time.perf_counter() - t
        drain(llm)
        requests = []
        sent.append([list(out.prompt_token_ids) for out in outs])
        for out in outs:
            requests.append(
                {
                    "prompt_len": len(out.prompt_token_ids),
                    "token_ids": list(out.outputs[0].token_ids),
                    "num_cached_tokens": out.num_cached_tokens,
                    "kv_transfer_params": out.kv_transfer_params,
                }
            )
        batches.append({"wall_s": wall, "requests": requests})
        if totals is not None:
            batches[-1]["connector_stats"] = dict(totals)
        if encoder_runs is not None:
            batches[-1]["encoder_runs"] = encoder_runs[0]
            batches[-1]["ec"] = _ec_stats()
            encoder_runs[0] = 0
    result: dict[str, Any] = {"init_s": init_s, "batches": batches, "async_scheduling": async_on}
    if spec.get("state_digests"):
        result["state_digests"] = _state_digests(llm)
    if totals is not None:
        result["prometheus"] = _connector_prometheus()
    return result


def _state_digests(llm: Any) -> dict[str, list[str]]:
    """What vLLM itself keeps of a hybrid model's recurrent states: for every block its own prefix
    cache holds in a state group ("align" mode: the state after exactly the block's hashed tokens),
    the sha256 of every layer's states in that block, keyed by that token boundary. A test compares
    these across engines: a state our connector loaded must equal the one vLLM computed itself."""
    import hashlib

    import torch
    from vllm.v1.core.kv_cache_utils import get_group_id
    from vllm.v1.kv_cache_interface import MambaSpec

    core = llm.llm_engine.engine_core.engine_core
    sched = core.scheduler
    groups = {
        i: list(g.layer_names)
        for i, g in enumerate(sched.kv_cache_config.kv_cache_groups)
        if isinstance(g.kv_cache_spec, MambaSpec)
    }
    layers = core.model_executor.driver_worker.worker.model_runner.compilation_config.static_forward_context
    out: dict[str, list[str]] = {}
    for key, found in sched.kv_cache_manager.block_pool.cached_block_hash_to_block._cache.items():
        gid = get_group_id(key)
        if gid not in groups:
            continue
        for block in found.values() if isinstance(found, dict) else [found]:
            h = hashlib.sha256()
            for name in groups[gid]:
                states = layers[name].kv_cache
                for state in states[0] if isinstance(states, list) else states:
                    h.update(state[block.block_id].contiguous().view(torch.uint8).numpy().tobytes())
            out.setdefault(str(block.block_hash_num_tokens), []).append(h.hexdigest())
    return out


def _connector_prometheus() -> dict[str, float]:
    """The connector's series in vLLM's Prometheus registry (what vLLM's /metrics would serve)."""
    from prometheus_client import REGISTRY

    return {
        s.name: s.value
        for family in REGISTRY.collect()
        for s in family.samples
        if s.name.startswith("vllm:kvserver_") and s.name.endswith("_total")
    }


def main(argv: list[str]) -> int:
    spec_path, result_path = argv[1], argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    result = _run(spec)
    with open(result_path, "w") as f:
        json.dump(result, f)
    # Leave without running interpreter teardown of vLLM's global state: the result is written,
    # and a slow or noisy shutdown must not make a passing run look failed.
    sys.stdout.flush()
    sys.stderr.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

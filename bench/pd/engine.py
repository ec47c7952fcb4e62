"""One vLLM engine behind a line protocol on stdin/stdout, for bench/pd/proxy.py (prefill/decode).

Run with the .venv-vllm interpreter: `python bench/pd/engine.py SPEC_JSON`. SPEC: {"model", "block_size",
"max_model_len", "kv_transfer_config" | null}. After start it prints {"ready": true, "init_s"}; then each
stdin line {"prompts": [[token ids], ...], "max_tokens": n} is answered by one line {"wall_s",
"requests": [{"token_ids", "num_cached_tokens", "ttft_s"}]} (greedy; ttft_s: vLLM's first-token
latency of the request in this engine). `{"stats": true}` answers the connector counters so far.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def main() -> None:
    spec = json.loads(sys.argv[1])
    out = os.fdopen(os.dup(1), "w")  # the protocol's own channel; vLLM logs to stdout: send it to stderr
    os.dup2(2, 1)
    t0 = time.perf_counter()
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
        disable_log_stats=False,
    )
    if spec.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = spec["kv_transfer_config"]
    llm = LLM(**kwargs)
    from kvtestkit.engines.engine_runner import drain  # the same end of a batch as the test engines

    totals: dict[str, float] = {}
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    make_stats = sched.make_stats

    def capture(*args: Any, **kw: Any) -> Any:  # the connector's counters, as vLLM routes them to its stats
        stats = make_stats(*args, **kw)
        for name, value in (getattr(stats, "kv_connector_stats", None) or {}).items():
            if isinstance(value, (int, float)):
                totals[name] = totals.get(name, 0) + value
        return stats

    sched.make_stats = capture
    out.write(json.dumps({"ready": True, "init_s": time.perf_counter() - t0}) + "\n")
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("stats"):
            out.write(json.dumps(totals) + "\n")
            out.flush()
            continue
        params = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], ignore_eos=True, detokenize=False)
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in req["prompts"]], params, use_tqdm=False)
        wall = time.perf_counter() - t
        drain(llm)  # the producer's background saves end (and are counted) before the answer
        reqs = [
            {
                "token_ids": list(o.outputs[0].token_ids),
                "num_cached_tokens": o.num_cached_tokens,
                "ttft_s": float(getattr(o.metrics, "first_token_latency", 0.0) or 0.0),
            }
            for o in outs
        ]
        out.write(json.dumps({"wall_s": wall, "requests": reqs}) + "\n")
        out.flush()


if __name__ == "__main__":
    main()

"""Does the `lmcache` configuration of bench/serving really reuse KV across engines, and does what it
loads give the tokens recompute gives? Runs with the .venv-vllm interpreter, after
scripts/make-lmcache-env.sh:

    .venv-vllm/bin/python -m bench.serving.lmcache_check

One LMCache MP server and two engines (LMCacheMPConnector), one engine without a connector, on the
bench model: engine 0 prefills a prompt (LMCache stores its full 256-token chunks), engine 1, whose
prefix cache is empty, serves the same prompt (it should load those chunks from LMCache), then the
no-connector engine recomputes it. Prints the tokens each generated and engine 1's prompt-token
sources from vLLM's /metrics; exit status 1 when engine 1 loaded nothing, the tokens differ, or a
generated token's logprob differs from recompute's by 1e-3 or more.
"""

from __future__ import annotations

import json
import random
import re
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import bench.serving.engines as eng
from bench.serving.client import scrape
from bench.serving.run import MAX_MODEL_LEN, MODEL
from kvtestkit.engines.vllm_harness import build_model

PROMPT = random.Random(37).choices(range(MODEL["vocab_size"]), k=600)  # 2 full chunks (512 tokens), 88 more


def complete(url: str, prompt: list[int], max_tokens: int = 16) -> tuple[list[int], list[float]]:
    """The generated tokens and their logprobs (equal tokens alone say little on a random model)."""
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "logprobs": 1,
        "return_tokens_as_token_ids": True,  # the engines have no tokenizer (--skip-tokenizer-init)
    }
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            choice = json.loads(r.read())["choices"][0]
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{url}: HTTP {e.code}: {e.read()[:1000]!r}") from None
    return [int(t) for t in choice["token_ids"]], [float(x) for x in choice["logprobs"]["token_logprobs"]]


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="lmcache-check-") as tmp_s:
        tmp = Path(tmp_s)
        model = build_model(tmp / "model", MODEL)
        dep = eng.start("lmcache", model, 2, MAX_MODEL_LEN, tmp / "lmcache")
        try:
            stored = complete(dep.engines[0].url, PROMPT)
            before = scrape([dep.engines[1].url])
            loaded = complete(dep.engines[1].url, PROMPT)
            after = scrape([dep.engines[1].url])
        finally:
            dep.stop()
        assert dep.lmcache is not None
        server_log = [
            re.sub(r"\x1b\[[0-9;]*m", "", line).split("LMCache INFO:")[-1].strip()
            for line in dep.lmcache.log_path.read_text(errors="replace").splitlines()
            if "transfer strategy" in line or "Stored " in line or "Retrieved " in line
        ]
        base = eng.start("none", model, 1, MAX_MODEL_LEN, tmp / "none")
        try:
            recomputed = complete(base.engines[0].url, PROMPT)
        finally:
            base.stop()
    sources = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in ("computed", "local_hit", "external")}
    print(f"engine 0 (stores):     {stored[0]}")
    print(f"engine 1 (loads):      {loaded[0]}")
    print(f"no connector:          {recomputed[0]}")
    drift = max(abs(a - b) for a, b in zip(loaded[1], recomputed[1], strict=True))
    print(f"largest logprob difference, engine 1 vs no connector: {drift:.2e}")
    print(f"engine 1's {len(PROMPT)} prompt tokens: {json.dumps(sources)}")
    print("LMCache server:", *server_log, sep="\n  ")
    ok = sources["external"] > 0 and loaded[0] == recomputed[0] == stored[0] and drift < 1e-3
    print("OK: engine 1 loaded from LMCache, tokens equal recompute" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

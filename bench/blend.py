"""CacheBlend evaluation: compute saved and quality against a full recompute, on a small trained Llama.

Reproduce: `uv run python -m bench.blend` (trains the model once, ~30 min on 2 shared cores, and keeps
it in .cache/blend-model/; `--steps 0` uses an untrained random model instead). Starts a real
kvserver (chunk size 64), pre-stores a corpus of documents (each computed alone, positions 0..),
then for RAG-style prompts (a system prefix, 4-8 corpus documents of 256-512 tokens in shuffled
order, a query) loads the matching chunks through blend_lookup/retrieve and prefills with
kvconnector.blend at several recompute ratios. Quality is measured over G generated tokens: the
full recompute generates greedily, every variant is decoded teacher-forced on those tokens, and we
report top-1 agreement of the next-token logits and KL(full || variant), averaged over tokens and
prompts. "Compute saved" is 1 - prefill FLOPs / full prefill FLOPs (projections, MLP, attention);
the wall-clock ratio of the prefill, measured in the same run, is printed next to it.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench.blend_model import BOS, QUERY, Topic, load_or_train, make_model

from kvconnector.blend import BlendStore, ChunkCodec, ReusedChunk, blend_prefill, full_prefill
from kvprotocol import Client
from kvtestkit.ports import free_port

CHUNK = 64
RATIOS = (0.0, 0.05, 0.15, 0.30)


def start_server() -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    exe = Path(sys.executable).parent / "kvserver"
    proc = subprocess.Popen(
        [
            str(exe),
            "start",
            "--port",
            str(port),
            "--l1-size-gb",
            "0.5",
            "--http-port",
            "0",
            "--chunk-size",
            str(CHUNK),
            "--log-level",
            "warning",
        ],
        stdout=subprocess.DEVNULL,
    )
    url = f"tcp://127.0.0.1:{port}"
    with Client(url, timeout=0.5) as c:
        for _ in range(100):
            try:
                c.call("ping")
                return proc, url
            except Exception:
                time.sleep(0.1)
    raise RuntimeError("kvserver did not start")


def doc_kv(model: torch.nn.Module, tokens: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    with torch.no_grad():
        cache = model(torch.tensor([tokens]), use_cache=True).past_key_values
    return [layer.keys[0] for layer in cache.layers], [layer.values[0] for layer in cache.layers]


def decode(model: torch.nn.Module, first_logits: torch.Tensor, cache: object, forced: list[int]) -> torch.Tensor:
    """Logits at each of len(forced) steps: step 0 is the prefill's, step i follows forced[:i]."""
    out = [first_logits]
    with torch.no_grad():
        for tok in forced[:-1]:
            out.append(model(torch.tensor([[tok]]), cache=cache, use_cache=True).logits[0, -1])
    return torch.stack(out)


def greedy(model: torch.nn.Module, prompt: torch.Tensor, n: int) -> tuple[list[int], torch.Tensor, float]:
    started = time.perf_counter()
    ref = full_prefill(model, prompt)
    seconds = time.perf_counter() - started
    toks, logits, cache = [], [ref.logits], ref.cache
    with torch.no_grad():
        for i in range(n):
            toks.append(int(logits[-1].argmax()))
            if i < n - 1:
                logits.append(model(torch.tensor([[toks[-1]]]), cache=cache, use_cache=True).logits[0, -1])
    return toks, torch.stack(logits), seconds


def compare(full: torch.Tensor, other: torch.Tensor) -> tuple[float, float]:
    p = torch.log_softmax(full.double(), -1)
    q = torch.log_softmax(other.double(), -1)
    kl = (p.exp() * (p - q)).sum(-1).mean().item()
    agree = (full.argmax(-1) == other.argmax(-1)).double().mean().item()
    return agree, kl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=160, help="training steps (0: untrained random model)")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--gen", type=int, default=32, help="generated tokens compared per prompt")
    ap.add_argument("--docs-per-topic", type=int, default=10)
    ap.add_argument("--topics", type=int, default=6)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--model-path", default=".cache/blend-model/llama8x128-s{steps}.pt")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    if args.steps:
        model, trained = load_or_train(Path(args.model_path.format(steps=args.steps)), args.steps)
        print(f"model: Llama 8 layers x 128 hidden, trained {args.steps} steps ({'now' if trained else 'cached'})")
    else:
        model = make_model().eval()
        print("model: Llama 8 layers x 128 hidden, random init (untrained)")
    cfg = model.config
    codec = ChunkCodec(
        cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads, CHUNK
    )
    rng = np.random.default_rng(args.seed)
    topics = Topic.all()[: args.topics]
    corpus = {
        t: [topic.document(rng, int(rng.integers(256, 513))) for _ in range(args.docs_per_topic)]
        for t, topic in enumerate(topics)
    }
    proc, url = start_server()
    rows: dict[str, list[tuple[float, float, float, float]]] = {}
    reuse_frac: list[float] = []
    try:
        with BlendStore(url, "bench-blend-llama", codec) as store:
            for docs in corpus.values():
                for d in docs:
                    k, v = doc_kv(model, d)
                    store.store_document(d, k, v)
            n_docs = sum(len(d) for d in corpus.values())
            print(f"corpus: {n_docs} documents stored ({store.stats.stored_chunks} chunks)")
            for _ in range(args.prompts):
                t = int(rng.integers(len(topics)))
                picked = rng.choice(len(corpus[t]), int(rng.integers(4, 9)), replace=False)
                system = [BOS, *range(4, 16)]
                query = [QUERY, *topics[t].walk(rng, 16)]
                parts = [system, *[corpus[t][i] for i in picked], query]
                starts = [sum(len(p) for p in parts[:i]) for i in range(len(parts))]
                tokens = [x for p in parts for x in p]
                prompt = torch.tensor(tokens)
                loaded = store.load(tokens, starts)
                chunks = [ReusedChunk(c.start, c.ref_pos, c.k, c.v) for c in loaded]
                reuse_frac.append(len(chunks) * CHUNK / len(tokens))
                forced, full_logits, full_s = greedy(model, prompt, args.gen)
                variants = [("full reuse, no recompute", dict(reuse_only=True, recompute_ratio=0.0))]
                variants += [(f"blend, recompute {int(r * 100)}%", dict(recompute_ratio=r)) for r in RATIOS]
                for name, kw in variants:
                    started = time.perf_counter()
                    out = blend_prefill(model, prompt, chunks, **kw)  # type: ignore[arg-type]
                    seconds = time.perf_counter() - started
                    agree, kl = compare(full_logits, decode(model, out.logits, out.cache, forced))
                    rows.setdefault(name, []).append((out.saved, seconds / full_s, agree, kl))
                print(f"  prompt {len(tokens)} tokens, {len(picked)} docs, {len(chunks)} chunks reused", flush=True)
            print(f"blend store stats: {store.stats}")
    finally:
        proc.terminate()
        proc.wait(10)
    print(
        f"\nprompts: {args.prompts}, tokens reused from the blend index: "
        f"{statistics.mean(reuse_frac) * 100:.1f}% of prompt tokens (mean); generated tokens compared: {args.gen}\n"
    )
    print("| method | prefill compute saved | prefill wall time vs full | top-1 agreement | KL(full ‖ method), nats |")
    print("|---|---|---|---|---|")
    print("| full recompute (reference) | 0% | 1.00 | 100% | 0 |")
    for name, vals in rows.items():
        saved, wall, agree, kl = (statistics.mean(v[i] for v in vals) for i in range(4))
        print(f"| {name} | {saved * 100:.1f}% | {wall:.2f} | {agree * 100:.1f}% | {kl:.4f} |")


if __name__ == "__main__":
    main()

"""Where a kvserver request's time goes: a cProfile of the server process plus per-stage timings.

Nothing in the server's code path is instrumented. Two views, both against a real server process:
- `--stages`: the same work the server does per request, timed in this process with
  time.perf_counter_ns (decode + validate, handler, reply packing), next to the round trip.
- default: the server runs under cProfile (`python -m cProfile -m kvserver start`) while this script
  sends pings and 4096-token lookups; on exit the top functions by own time are printed.
`--http` starts the HTTP admin API too (it shares the event loop) to see what it costs a request.
Run: `uv run python -m bench.profile_server [--stages] [--http]`.
"""

from __future__ import annotations

import argparse
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvprotocol import Client, KeySpace, LayoutDescriptor, flows, pack_tokens
from kvprotocol import requests as rq
from kvprotocol.kvsum import kvsum64

from bench.server import CHUNK, free_port, start_server

LAYOUT = LayoutDescriptor("vllm_cpu", "float16", 2, 32, 1024, CHUNK, (512,))


def start(profile_to: str | None, http: bool) -> tuple[subprocess.Popen[bytes], str]:
    head = (
        [sys.executable, "-m", "cProfile", "-o", profile_to, "-m", "kvserver"]
        if profile_to
        else [sys.executable, "-m", "kvserver"]
    )
    return start_server(1.0, command=head, http_port=free_port() if http else 0)


def prepare(c: Client, n_tokens: int) -> rq.Lookup:
    c.register_engine(model="prof", world_size=1, rank=0, groups=[rq.LayoutW(**LAYOUT.to_wire())])
    ks = KeySpace.from_layouts("prof", 1, [LAYOUT]).wire()
    tokens = pack_tokens(np.arange(n_tokens, dtype=np.uint32))
    zero = bytes(LAYOUT.object_bytes)
    flows.store_and_commit(
        c.send,
        rq.Store(keyspace=ks, tokens=tokens, rank=0, mode="tcp"),
        lambda _r, slots: ([zero] * len(slots), [kvsum64(zero)] * len(slots)),
    )
    return rq.Lookup(keyspace=ks, tokens=tokens)


def timed(fn, n: int) -> float:  # type: ignore[no-untyped-def]
    """Median microseconds of n calls."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        out.append(time.perf_counter_ns() - t0)
    return statistics.median(out) / 1e3


def stages(c: Client, lookup: rq.Lookup, n: int) -> None:
    """The per-request steps, each timed alone in this process (same code the server runs)."""
    from kvprotocol._client import _encode
    from kvprotocol._envelope import encode_reply, ok_reply
    from kvprotocol._messages import decode_request
    from kvprotocol._replies import LookupReply

    ping_frame = _encode(rq.Ping(), 1, "x" * 43)
    lookup_frame = _encode(lookup, 1, "x" * 43)
    reply = LookupReply(hit_tokens=4096, hit_chunks=16, num_chunks=16, chunk_size=256)
    rows = {
        "round trip ping": timed(lambda: c.ping(), n),
        "round trip lookup 4096": timed(lambda: c.send(lookup), n),
        "client encode lookup": timed(lambda: _encode(lookup, 1, "x" * 43), n),
        "server decode ping": timed(lambda: decode_request(ping_frame), n),
        "server decode lookup 4096": timed(lambda: decode_request(lookup_frame), n),
        "server encode reply": timed(lambda: encode_reply(ok_reply(1, reply)), n),
    }
    from kvprotocol import chunk_hashes

    from kvserver.l1.eviction.lhd import LHDPolicy
    from kvserver.service.hash_memo import HashMemo

    toks = np.arange(4096, dtype=np.uint32)
    rows["chunk hashes 4096 tokens"] = timed(lambda: chunk_hashes(toks, CHUNK), n)
    memo, packed = HashMemo(), pack_tokens(toks)
    memo.hashes("", packed, CHUNK)
    rows["chunk hashes 4096, memo hit"] = timed(lambda: memo.hashes("", packed, CHUNK), n)
    policy, chain = LHDPolicy[int](), list(range(16))  # a 16-chunk prefix, as the lookup's touches see it
    for key, parent in zip(chain, [None, *chain[:-1]]):
        policy.on_reserve(key, parent)
    for key in reversed(chain):
        policy.on_insert(key)
    rows["lhd touches, 16 keys (after reply)"] = timed(lambda: policy.on_access_many(chain[::-1]), n)
    for name, us in rows.items():
        print(f"{name:<32} {us:8.1f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--stages", action="store_true")
    ap.add_argument("--http", action="store_true", help="run the HTTP admin API on the same loop")
    ap.add_argument("-n", type=int, default=3000)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = None if args.stages else str(Path(tmp) / "server.prof")
        proc, url = start(out, args.http)
        try:
            with Client(url, timeout=10) as c:
                lookup = prepare(c, 4096)
                if args.stages:
                    stages(c, lookup, args.n)
                else:
                    print(
                        f"ping p50 {timed(lambda: c.ping(), args.n):.1f} us, lookup 4096 p50 "
                        f"{timed(lambda: c.send(lookup), args.n):.1f} us (under cProfile: slower than real)"
                    )
        finally:
            proc.terminate()
            proc.wait()
        if out:
            pstats.Stats(out).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()

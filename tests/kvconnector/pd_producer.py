"""A producer engine process for the reservation tests: an EngineClient that stores one request's
prompt chunk by chunk, as a kv_producer's chunked prefill does, one step per line of stdin.

    python pd_producer.py URL SEED CHUNKS RESERVATION|-
stdin: `step` saves the next chunk (tokens [0, (k+1) C), skip k C) and prints one JSON line with the
SaveResult; `exit` ends the process. The KV it stores is GEO.random_kv(.., seed=SEED).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

import numpy as np

from engine_kv_helpers import Geometry
from kvconnector.engine_client import EngineClient

GEO = Geometry("vllm_cpu", chunk_size=64)
MODEL = "pd/model"


def tokens_of(seed: int, chunks: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 30000, size=chunks * GEO.chunk_size)


def main() -> None:
    url, seed, chunks, reservation = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    tokens = tokens_of(seed, chunks)
    blocks = list(range(chunks * GEO.chunk_size // GEO.block_size))
    with EngineClient(url, MODEL, 1, 0, [GEO.layout()], mode="shm", timeout=5.0) as client:
        assert client.register(GEO.random_kv(len(blocks), seed=seed))
        done = 0
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            if line.strip() == "exit":
                break
            res = client.save(
                tokens[: (done + 1) * GEO.chunk_size],
                blocks,
                skip_tokens=done * GEO.chunk_size,
                reservation=None if reservation == "-" else reservation,
                total_chunks=chunks,
            )
            if res.ok:
                done += 1
            print(json.dumps({**asdict(res), "done": done}), flush=True)


if __name__ == "__main__":
    main()

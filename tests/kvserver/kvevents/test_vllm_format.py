"""Our KV-event payloads, decoded by vLLM's own classes (from .venv-vllm), are what we meant to send."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import msgpack
import pytest

from kvevents_util import CHUNK, start_event_server
from kvtestkit.kvhelpers import payload, register, store, tiny_layout
from kvprotocol import chunk_hashes, pack_tokens
from kvserver.kvevents import END_SEQ

REPO = Path(__file__).resolve().parents[3]
VLLM_PYTHON = Path(os.environ.get("KV_VLLM_VENV", REPO / ".venv-vllm")) / "bin" / "python"
DECODER = Path(__file__).resolve().parent / "vllm_decode.py"
TOKENS = list(range(7, 7 + CHUNK * 3))


def _vllm_decode(payloads: list[bytes], tmp_path: Path) -> dict:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"{VLLM_PYTHON} missing: build it with scripts/make-vllm-env.sh")
    path = tmp_path / "payloads.msgpack"
    path.write_bytes(msgpack.packb(payloads))
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache")}
    done = subprocess.run(
        [str(VLLM_PYTHON), str(DECODER), str(path)], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("hash_format", ["bytes", "int"])
def test_vllm_decodes_our_batches_byte_for_byte(server_factory, tmp_path, hash_format):
    srv = start_event_server(server_factory, "--l1-size-gb", "0.25", "--kv-events-hash-format", hash_format)
    size = tiny_layout().object_bytes
    with srv.proc.client() as c:
        ks, _ = register(c, layouts=[tiny_layout()])
        store(c, ks, TOKENS[: 2 * CHUNK], lambda ch, g: payload(ch, size))
        store(c, ks, TOKENS, lambda ch, g: payload(ch, size))
        c.call("clear")
    batches = srv.replay(0)
    decoded = _vllm_decode([b.payload for b in batches], tmp_path)
    assert decoded["end_seq"] == END_SEQ.hex()

    hashes = chunk_hashes(pack_tokens(TOKENS), CHUNK)
    if hash_format == "int":
        want = [int.from_bytes(h, "big") & ((1 << 64) - 1) for h in hashes]
    else:
        want = [h.hex() for h in hashes]
    events = [ev for b in decoded["batches"] for ev in b["events"]]
    assert all(b["dp_rank"] == 0 for b in decoded["batches"])
    assert events == [
        {"type": "AllBlocksCleared"},
        {
            "type": "BlockStored",
            "hashes": want[:2],
            "parent": None,
            "tokens": 2 * CHUNK,
            "block_size": CHUNK,
            "medium": "kvserver_l1",
            "lora_id": None,
            "lora_name": None,
        },
        {
            "type": "BlockStored",
            "hashes": want[2:],
            "parent": want[1],
            "tokens": CHUNK,
            "block_size": CHUNK,
            "medium": "kvserver_l1",
            "lora_id": None,
            "lora_name": None,
        },
        {"type": "BlockRemoved", "hashes": want, "medium": "kvserver_l1"},
    ]

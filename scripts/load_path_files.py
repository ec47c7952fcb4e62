"""List the project files a load runs code in: EngineClient.lookup (with a session) + EngineClient.load.

Why: docs/engine.md promises that a load is traceable through few files; this counts them instead
of guessing. It starts a real kvserver, saves one prompt, then profiles the lookup and the load of
it (both threads and C calls into the `_kvcopy` extension, mapped to the csrc/ files they run) and
prints every workspace file whose code ran. The vLLM connector layer above EngineClient is listed in
docs/engine.md by hand (it needs a running vLLM).

    uv run python scripts/load_path_files.py                 # shm, the host copier
    uv run python scripts/load_path_files.py --mode tcp --copy-backend torch
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

CSRC = "packages/kvconnector/csrc"
# csrc/ files each extension function runs (kvcopy.cpp holds the bindings)
_CPP = {
    "copy_checksum": [f"{CSRC}/kvcopy.cpp", f"{CSRC}/checksum_copy.cpp", f"{CSRC}/checksum.cpp"],
    "batch_copy": [f"{CSRC}/kvcopy.cpp", f"{CSRC}/batch_copy.cpp"],
    "checksum": [f"{CSRC}/kvcopy.cpp", f"{CSRC}/checksum.cpp"],
    "checksum_bytes": [f"{CSRC}/kvcopy.cpp", f"{CSRC}/checksum.cpp"],
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", default="shm", choices=("shm", "tcp"))
    p.add_argument("--copy-backend", default="auto", choices=("auto", "host", "torch"))
    args = p.parse_args(argv)
    os.environ.setdefault("KVSERVER_STATE_DIR", tempfile.mkdtemp(prefix="kvstate-"))

    import torch
    from serverproc import ServerProc, free_port

    from kvconnector.engine_client import EngineClient
    from kvconnector.layouts import vllm_cpu_layout
    from kvprotocol import new_session_id

    seen: set[str] = set()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            path = Path(frame.f_code.co_filename)
            if path.is_relative_to(ROOT) and not path.relative_to(ROOT).parts[0].startswith(".venv"):
                seen.add(str(path.relative_to(ROOT)))
                if os.environ.get("TRACE_FUNCS"):
                    seen.add(f"{path.relative_to(ROOT)}:{frame.f_code.co_name}")
        elif event == "c_call" and getattr(arg, "__module__", "") == "kvconnector._kvcopy":
            seen.update(_CPP.get(arg.__name__, [f"{CSRC}/kvcopy.cpp"]))

    log = Path(tempfile.mkdtemp(prefix="kvtrace-")) / "kvserver.log"
    server = ServerProc(free_port(), ["--l1-size-gb", "0.05", "--chunk-size", "64"], log, http_port=0, env={})
    server.start()
    try:
        layout = vllm_cpu_layout(
            num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, dtype="float16", chunk_size=64
        )
        kv = [torch.randn(32, 2, 16, 16).half() for _ in range(2)]
        tokens = list(range(256))
        with EngineClient(
            server.url, "trace-model", 1, 0, [layout], mode=args.mode, copy_backend=args.copy_backend
        ) as client:
            if not (client.register(kv) and client.save(tokens, list(range(16))).ok):
                raise SystemExit("could not store the prompt to load")
            sys.setprofile(profile)
            threading.setprofile(profile)
            try:
                session = new_session_id()  # the vLLM scheduler makes one per request
                hit = client.lookup(tokens, session=session)
                res = client.load(session, tokens, list(range(16, 32)), 0, hit.hit_tokens)
            finally:
                sys.setprofile(None)
                threading.setprofile(None)
            if not (res.ok and res.loaded_tokens == len(tokens)):
                raise SystemExit(f"the load failed: {res}")
    finally:
        server.stop()
    for name in sorted(seen):
        print(name)
    print(f"{len(seen)} files", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

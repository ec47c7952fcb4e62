"""GPU validation of the CUDA data path (#35 item 5): one run, at most ~8 minutes, on a lent GPU.

Why a script and not tests: the CUDA path (`kvconnector._torch_copy.TorchCopier`: cudaHostRegister of
the shm arena, staged host<->device copies, index ops on the KV tensors) is built and CPU-tested, but
only a GPU can say whether its bytes survive and how fast it is. The lent machine has no network and
no workspace install, so this script builds the C++ extension there, starts a real kvserver there,
and measures (docs/engine.md, "GPU validation"):

  a. a bitwise round trip through the kvserver for each layout (bf16 and fp16), CUDA tensors shaped
     and strided as each attention backend allocates them, and for every vLLM 0.32 backend layout
     the connector's reader names (kvtestkit.backend_layouts: FlashAttention, FlashInfer NHD/HND,
     Triton, Flex, the MLA backends, fp8 ones included);
  b. H2D (load) and D2H (save) GB/s of EngineClient against a raw pinned copy of the same bytes, block
     sizes 16 and 64, alternating rounds: medians, ranges, ratios and the worst layout;
  c. the cudaHostRegister cost per GiB of an arena-sized shm range;
  d. saves and loads (on the copier's side stream) while matrix products run on another stream: no corruption,
     and the products' slowdown;
  e. the time to load a 16k-token prefix of a 32-layer bf16 model (8 KV heads x 128) into GPU blocks.

Here (network):   bash scripts/gpu_wheels.sh
There (the GPU):  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:packages/kvprotocol/src:packages/kvserver/src:packages/kvconnector/src && python3 bench/gpu_check.py --out $OUT

`--dry-run` runs the same steps, through the same functions, on CPU tensors at small sizes (a few
seconds; tests/bench/test_gpu_check.py runs it in CI). Without CUDA and without `--dry-run` it exits
at once with one line and status 2. Exit status 1: some round trip or corruption check failed.
"""  # noqa: E501

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import mmap
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvtestkit.ports import free_port  # stdlib only: PYTHONPATH holds packages/kvtestkit/src on a bare machine

ROOT = Path(__file__).resolve().parents[1]
KVCONNECTOR_DIR = ROOT / "packages" / "kvconnector"
GIB = 1 << 30
MODEL = "gpu-check/model"
_ROUNDS = itertools.count(1)  # token ranges: every round of the run saves new keys


# -- sizes ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sizes:
    """Everything that differs between the GPU run and the CPU dry run (the steps do not)."""

    chunk: int  # the server's chunk size (tokens)
    rt_layers: int  # round trips (a): a small model
    heads: int
    head_dim: int
    latent: int  # MLA latent width (DeepSeek: kv_lora_rank 512 + rope 64)
    rt_chunks: int
    bw_layers: int  # bandwidth (b), overlap (d) and prefix (e): a Llama-8B-like KV (32 x 8 x 128)
    bw_chunks: int  # chunks per timed round
    rounds: int
    l1_gb: float
    register_gib: float  # (c)
    matmul_n: int  # (d)
    matmul_iters: int
    prefix_tokens: int  # (e)
    prefix_rounds: int

    @staticmethod
    def gpu() -> Sizes:
        return Sizes(
            chunk=256,
            rt_layers=4,
            heads=8,
            head_dim=128,
            latent=576,
            rt_chunks=4,
            bw_layers=32,
            bw_chunks=8,  # 256 MiB a round for 32 x 8 x 128 bf16
            rounds=5,
            l1_gb=3.0,
            register_gib=4.0,
            matmul_n=8192,
            matmul_iters=300,  # ~0.4 s of bf16 products on an H100/H200
            prefix_tokens=16384,
            prefix_rounds=3,
        )

    @staticmethod
    def dry() -> Sizes:
        return Sizes(
            chunk=64,
            rt_layers=2,
            heads=2,
            head_dim=16,
            latent=24,
            rt_chunks=3,
            bw_layers=2,
            bw_chunks=2,
            rounds=3,
            l1_gb=0.1,
            register_gib=1 / 64,
            matmul_n=128,
            matmul_iters=20,
            prefix_tokens=1024,
            prefix_rounds=2,
        )


# -- setup: CUDA check, extension build, server ---------------------------------------------------------
def cuda_or_exit() -> None:
    """Leave at once, with one line and status 2, where the GPU run cannot work."""
    try:
        import torch
    except ImportError as exc:
        sys.exit(_exit_line(f"torch is not importable ({exc})"))
    if not torch.cuda.is_available():
        sys.exit(_exit_line(f"CUDA is not available (torch {torch.__version__}, CUDA build {torch.version.cuda})"))


def _exit_line(why: str) -> int:
    print(f"gpu_check: {why}; nothing measured (--dry-run rehearses the steps on CPU)", file=sys.stderr)
    return 2


def build_extension(jobs: int = 8) -> dict[str, Any]:
    """Build kvconnector._kvcopy in place for this interpreter (the lent machine has no install of ours).

    Must run before kvconnector is imported: its copy backend is chosen once, at import."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvcopy-build-") as tmp:
        cmd = [sys.executable, "setup.py", "-q", "build_ext", "--inplace", "-j", str(jobs), "-t", tmp]
        proc = subprocess.run(cmd, cwd=KVCONNECTOR_DIR, capture_output=True, text=True)
    out: dict[str, Any] = {"seconds": round(time.perf_counter() - t0, 2), "ok": proc.returncode == 0}
    if proc.returncode:
        out["error"] = (proc.stdout + proc.stderr)[-2000:]
    return out


@dataclass
class Server:
    """A real kvserver process (loopback, a free port, a private state dir); its arena is in /dev/shm."""

    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        """Stop it and remove the arena a stopped server leaves for a warm restart (a check keeps nothing)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for suffix in ("", ".journal", "-ec", "-ec.journal", ".lock"):
            Path(f"/dev/shm/gpucheck-{self.url.rsplit(':', 1)[1]}{suffix}").unlink(missing_ok=True)


def l1_size_gb(want: float) -> float:
    """The L1 to ask for: `want`, or 70% of what /dev/shm has free if that is less."""
    free = shutil.disk_usage("/dev/shm").free / GIB
    return round(min(want, 0.7 * free), 2)


@contextlib.contextmanager
def kvserver(state_dir: Path, l1_gb: float, chunk: int, timeout: float = 60.0) -> Iterator[Server]:
    """Start `python -m kvserver start` with this interpreter and PYTHONPATH (no HTTP admin port)."""
    from kvprotocol import Client, KVProtocolError

    port = free_port()
    log = state_dir / "kvserver.log"
    cmd = [sys.executable, "-m", "kvserver", "start", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--http-port", "0", "--l1-size-gb", str(l1_gb), "--ec-size-gb", "0.01", "--chunk-size", str(chunk)]
    cmd += ["--shm-prefix", "gpucheck", "--lease-ttl", "120"]
    env = {**os.environ, "KVSERVER_STATE_DIR": str(state_dir)}
    with open(log, "ab") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = Server(f"tcp://127.0.0.1:{port}", proc, log)
    try:
        deadline = time.monotonic() + timeout
        with Client(server.url, timeout=0.5) as c:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"kvserver exited with {proc.returncode}:\n{server.tail()}")
                try:
                    c.call("ping")
                    break
                except KVProtocolError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"kvserver did not answer within {timeout}s:\n{server.tail()}") from None
                    time.sleep(0.05)
        yield server
    finally:
        server.stop()


# -- devices ------------------------------------------------------------------------------------------
def sync(device: Any) -> None:
    """Wait for the current stream only (a side stream must not wait for the compute stream's work);
    a no-op on CPU, where torch ops are synchronous."""
    import torch

    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def sync_all(device: Any) -> None:
    """Wait for every stream of the device (before handing tensors from one stream to another)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pinned_bytes(n: int, device: Any) -> Any:
    """A page-locked host buffer (plain host memory on CPU): the raw-copy baseline's host side."""
    import torch

    return torch.empty(n, dtype=torch.uint8, pin_memory=device.type == "cuda")


# -- layouts as each backend allocates them -------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One attention backend's KV cache: how it is allocated, registered and which layout names it."""

    name: str
    supported: bool
    note: str
    block_axis: int = 0  # the axis of the *allocated* per-layer tensor that indexes blocks


CASES = [
    Case("vllm_cpu", True, "vLLM CPU backend: [num_blocks, H, block_size, 2*D] per layer"),
    Case(
        "flash_attn",
        True,
        "FlashAttention: [2, num_blocks, block_size, H, D] per layer (K plane, V plane)",
        block_axis=1,
    ),
    Case(
        "flashinfer_nhd",
        True,
        "FlashInfer NHD: [num_blocks, 2, block_size, H, D] per layer, registered as its [2, num_blocks, ...] "
        "transposed view under the flash_attn layout (same object bytes; strides read from the tensor)",
    ),
    Case(
        "mla_shared",
        True,
        "MLA latent: [num_blocks, block_size, latent] per layer, one object per chunk shared by the TP ranks "
        "(rank 0 saves, rank 1 of 2 loads)",
    ),
]


@dataclass(frozen=True)
class Model:
    layers: int
    heads: int
    head_dim: int
    latent: int
    block_size: int
    chunk: int
    dtype: Any


def layout_of(case: Case, m: Model) -> Any:
    """The layout descriptor the connector would register for this backend's cache."""
    from kvconnector.layouts import flash_attn_layout, mla_layout, vllm_cpu_layout

    common = {"num_layers": m.layers, "block_size": m.block_size, "dtype": m.dtype, "chunk_size": m.chunk}
    if case.name == "vllm_cpu":
        return vllm_cpu_layout(num_kv_heads=m.heads, head_dim=m.head_dim, **common)
    if case.name in ("flash_attn", "flashinfer_nhd"):
        return flash_attn_layout(num_kv_heads=m.heads, head_dim=m.head_dim, **common)
    if case.name == "mla_shared":
        return mla_layout(latent_dim=m.latent, shared=True, **common)
    raise ValueError(f"{case.name}: no layout yet")


def alloc_shape(case: Case, m: Model, num_blocks: int) -> tuple[int, ...]:
    """The per-layer tensor shape the backend allocates."""
    nb, bs, h, d = num_blocks, m.block_size, m.heads, m.head_dim
    return {
        "vllm_cpu": (nb, h, bs, 2 * d),
        "flash_attn": (2, nb, bs, h, d),
        "flashinfer_nhd": (nb, 2, bs, h, d),
        "mla_shared": (nb, bs, m.latent),
    }[case.name]


def allocate(case: Case, m: Model, num_blocks: int, device: Any, random: bool) -> list[Any]:
    """Per layer, a raw byte buffer viewed as the backend's dtype and shape (as vLLM allocates KV)."""
    import math

    import torch

    shape = alloc_shape(case, m, num_blocks)
    nbytes = math.prod(shape) * torch.empty((), dtype=m.dtype).element_size()
    out = []
    for _ in range(m.layers):
        if random:
            raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
        else:
            raw = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        out.append(raw.view(m.dtype).view(shape))
    return out


def registered(case: Case, tensors: list[Any]) -> list[Any]:
    """What the connector registers: the tensors themselves, or the view its layout tag indexes."""
    if case.name == "flashinfer_nhd":
        return [t.transpose(0, 1) for t in tensors]
    return tensors


# -- a rig: clients + KV for one (case, model) ------------------------------------------------------------
@dataclass
class Rig:
    """KV blocks saved from `src` blocks [0, n) and loaded into `dst` blocks `dst_ids` through the server.

    One client saves and loads (its cache holds both block ranges), except for the shared MLA layout,
    where rank 0 of 2 saves and rank 1 loads into its own cache: that proves one object serves both."""

    case: Case
    model: Model
    layout: Any
    saver: Any
    loader: Any
    src: list[Any]
    dst: list[Any]
    n: int
    dst_ids: list[int]
    pinned: bool
    clients: list[Any] = field(default_factory=list)

    @property
    def tokens_per_round(self) -> int:
        return self.n * self.model.block_size

    @property
    def object_bytes(self) -> int:
        return int(self.layout.object_bytes) * (self.tokens_per_round // self.model.chunk)

    def fresh_tokens(self) -> list[int]:
        """Tokens no earlier round of any rig used, so every save writes (nothing is 'already cached')."""
        base = next(_ROUNDS) * 100_000
        return [base + i for i in range(self.tokens_per_round)]

    def close(self) -> None:
        for c in self.clients:
            c.close()


def make_rig(url: str, case: Case, m: Model, chunks: int, device: Any, timeout: float = 60.0) -> Rig:
    """Allocate KV as the backend does, register it with EngineClient (shm mode, the torch copier)."""
    import random as _random

    from kvconnector.engine_client import EngineClient

    layout = layout_of(case, m)
    n = chunks * m.chunk // m.block_size
    shared = case.name == "mla_shared"
    world = 2 if shared else 1

    def client(rank: int) -> Any:
        return EngineClient(url, MODEL, world, rank, [layout], mode="shm", timeout=timeout, copy_backend="torch")

    if shared:
        src, dst = allocate(case, m, n, device, True), allocate(case, m, n, device, False)
        saver, loader = client(0), client(1)
        ok = saver.register(registered(case, src)) and loader.register(registered(case, dst))
        clients, dst_range = [saver, loader], list(range(n))
    else:
        src = dst = allocate(case, m, 2 * n, device, True)
        saver = loader = client(0)
        ok = saver.register(registered(case, src))
        clients, dst_range = [saver], list(range(n, 2 * n))
    rig = Rig(case, m, layout, saver, loader, src, dst, n, _random.Random(7).sample(dst_range, n), False)
    rig.clients = clients
    if not ok or loader.data_mode != "shm":
        rig.close()
        raise RuntimeError(f"{case.name}: register failed or no shm data plane (mode {loader.data_mode})")
    rig.pinned = all(getattr(c._plane.copier, "_pinned", None) is not None for c in clients)  # bench peeks
    zero_dst(rig)
    sync_all(device)
    return rig


def zero_dst(rig: Rig) -> None:
    """Zero the blocks a load will write, so a load that wrote nothing cannot pass the comparison."""
    import torch

    ids = torch.tensor(rig.dst_ids, device=rig.dst[0].device)
    for t in rig.dst:
        t.index_fill_(rig.case.block_axis, ids, 0)


def blocks_equal(rig: Rig) -> bool:
    """Bitwise: every loaded block equals the saved one, compared as bytes (NaN patterns included)."""
    import torch

    device = rig.src[0].device
    src_ids = torch.arange(rig.n, device=device)
    dst_ids = torch.tensor(rig.dst_ids, device=device)
    axis = rig.case.block_axis
    for s, d in zip(rig.src, rig.dst, strict=True):
        a = s.index_select(axis, src_ids).contiguous().view(torch.uint8)
        b = d.index_select(axis, dst_ids).contiguous().view(torch.uint8)
        if not torch.equal(a, b):
            return False
    return True


def save(rig: Rig, tokens: list[int]) -> float:
    """EngineClient.save of the rig's source blocks; seconds (the copies are complete on return)."""
    t0 = time.perf_counter()
    res = rig.saver.save(tokens, list(range(rig.n)))
    dt = time.perf_counter() - t0
    want = rig.tokens_per_round // rig.model.chunk
    if not res.ok or res.saved_chunks != want:
        raise RuntimeError(f"save failed: {res}")
    return dt


def load(rig: Rig, tokens: list[int]) -> float:
    """Lookup (leasing, untimed) then EngineClient.load into the rig's destination blocks; seconds."""
    from kvprotocol import new_session_id

    session = new_session_id()
    hit = rig.saver.lookup(tokens, session=session)
    if hit.hit_tokens != len(tokens):
        raise RuntimeError(f"lookup hit {hit.hit_tokens} of {len(tokens)} tokens: {hit}")
    t0 = time.perf_counter()
    res = rig.loader.load(session, tokens, rig.dst_ids, 0, len(tokens))
    dt = time.perf_counter() - t0
    if rig.loader is not rig.saver:
        rig.saver.release(session)  # the load ended the loader's leases only
    if not res.ok:
        raise RuntimeError(f"load failed: {res}")
    return dt


def cycle(rig: Rig) -> tuple[float, float, bool]:
    """One save -> zero -> load -> compare round on fresh tokens: (save s, load s, bitwise equal)."""
    tokens = rig.fresh_tokens()
    s = save(rig, tokens)
    zero_dst(rig)
    sync(rig.src[0].device)
    ld = load(rig, tokens)
    return s, ld, blocks_equal(rig)


# -- (a) round trips --------------------------------------------------------------------------------------
def roundtrips(url: str, sz: Sizes, device: Any) -> list[dict[str, Any]]:
    """Every case x dtype at block size 16: bitwise equal after save -> server -> load."""
    import torch

    out: list[dict[str, Any]] = []
    for case in CASES:
        for dtype in (torch.bfloat16, torch.float16):
            row: dict[str, Any] = {"layout": case.name, "dtype": str(dtype).removeprefix("torch.")}
            if not case.supported:
                out.append({**row, "status": "not supported yet", "note": case.note})
                continue
            m = Model(sz.rt_layers, sz.heads, sz.head_dim, sz.latent, 16, sz.chunk, dtype)
            row.update(_roundtrip(url, case, m, sz.rt_chunks, device))
            out.append(row)
    return out + backend_roundtrips(url, device)


def backend_roundtrips(url: str, device: Any) -> list[dict[str, Any]]:
    """Every vLLM 0.32 backend layout the reader names (kvtestkit.backend_layouts: the KV buffer laid
    out and viewed exactly as vLLM allocates it, the shapes the CPU tests prove against vLLM's own
    functions), through the connector's layout reader and the torch copier: bitwise equal, every other
    byte of the destination untouched."""
    from kvtestkit.backend_layouts import CASES as BACKENDS
    from kvtestkit.backend_layouts import round_trip

    out: list[dict[str, Any]] = []
    for i, name in enumerate(sorted(BACKENDS)):
        row: dict[str, Any] = {"layout": f"vllm:{name}", "dtype": BACKENDS[name].get("cache_dtype", "auto")}
        try:
            got = round_trip(url, name, name, "torch", seed=1000 + 2 * i, device=device)
        except Exception as exc:
            got = {"error": f"{type(exc).__name__}: {exc}"}
        ok = "error" not in got and got["equal"] and got["untouched"]
        row.update(status="ok" if ok else "FAIL", **got)
        out.append(row)
    return out


def _roundtrip(url: str, case: Case, m: Model, chunks: int, device: Any) -> dict[str, Any]:
    try:
        rig = make_rig(url, case, m, chunks, device)
    except Exception as exc:
        return {"status": "FAIL", "error": f"{type(exc).__name__}: {exc}"}
    try:
        _, _, equal = cycle(rig)
        shape = tuple(registered(case, rig.src)[0].shape)
        strides = tuple(registered(case, rig.src)[0].stride())
        row: dict[str, Any] = {"status": "ok" if equal else "FAIL", "bytes": rig.object_bytes, "pinned": rig.pinned}
        row.update(shape=shape, strides=strides)
        if not equal:
            row["error"] = "loaded blocks differ from the saved ones"
        return row
    except Exception as exc:
        return {"status": "FAIL", "error": f"{type(exc).__name__}: {exc}"}
    finally:
        rig.close()


# -- (b) bandwidth against a raw pinned copy -------------------------------------------------------------
def spread(xs: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3), "max": round(max(xs), 3)}


def raw_copy_gbps(nbytes: int, device: Any) -> Callable[[], tuple[float, float]]:
    """A timer of the baseline: one pinned host buffer <-> one device buffer, copy_(non_blocking=True)."""
    import torch

    host = pinned_bytes(nbytes, device)
    host.fill_(1)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def once() -> tuple[float, float]:
        sync(device)
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        sync(device)
        t1 = time.perf_counter()
        host.copy_(dev, non_blocking=True)
        sync(device)
        t2 = time.perf_counter()
        return nbytes / (t1 - t0) / 1e9, nbytes / (t2 - t1) / 1e9

    return once


def host_checksum_gbps(nbytes: int) -> float:
    """kvsum64 over host bytes: the verification pass the torch copier runs beside each load."""
    import numpy as np
    from kvconnector import copy as kvcopy

    buf = np.ones(nbytes, dtype=np.uint8)
    kvcopy.checksum_bytes(buf)
    t0 = time.perf_counter()
    kvcopy.checksum_bytes(buf)
    return nbytes / (time.perf_counter() - t0) / 1e9


def bandwidth(url: str, sz: Sizes, device: Any) -> dict[str, Any]:
    """Per supported case and block size (16, 64): load and save GB/s against the raw copy, alternated."""
    import torch

    rows: list[dict[str, Any]] = []
    for case in [c for c in CASES if c.supported]:
        for bs in (16, 64):
            m = Model(sz.bw_layers, sz.heads, sz.head_dim, sz.latent, bs, sz.chunk, torch.bfloat16)
            rows.append(_bandwidth_row(url, case, m, sz, device))
    ok = [r for r in rows if "load_ratio" in r]
    worst = min(ok, key=lambda r: min(r["load_ratio"], r["save_ratio"]), default=None)
    nbytes = rows[0].get("bytes", 1 << 20) if rows else 1 << 20
    return {
        "rows": rows,
        "worst": None if worst is None else {k: worst[k] for k in ("layout", "block_size", "load_ratio", "save_ratio")},
        "goal_ratio": 0.9,
        "host_checksum_gbps": round(host_checksum_gbps(nbytes), 2),
    }


def _bandwidth_row(url: str, case: Case, m: Model, sz: Sizes, device: Any) -> dict[str, Any]:
    row: dict[str, Any] = {"layout": case.name, "block_size": m.block_size}
    try:
        rig = make_rig(url, case, m, sz.bw_chunks, device)
    except Exception as exc:
        return {**row, "error": f"{type(exc).__name__}: {exc}"}
    try:
        nbytes = rig.object_bytes
        raw = raw_copy_gbps(nbytes, device)
        cycle(rig)  # warm-up: allocator, first faults of the arena slots
        raw()
        h2d, d2h, loads, saves, equal = [], [], [], [], True
        for _ in range(sz.rounds):  # alternate the baseline and ours, so drift hits both
            rh, rd = raw()
            s, ld, eq = cycle(rig)
            h2d.append(rh)
            d2h.append(rd)
            saves.append(nbytes / s / 1e9)
            loads.append(nbytes / ld / 1e9)
            equal &= eq
        row.update(bytes=nbytes, pinned=rig.pinned, bitwise_equal=equal)
        row.update(raw_h2d_gbps=spread(h2d), load_gbps=spread(loads), raw_d2h_gbps=spread(d2h), save_gbps=spread(saves))
        row["load_ratio"] = round(statistics.median(loads) / statistics.median(h2d), 4)
        row["save_ratio"] = round(statistics.median(saves) / statistics.median(d2h), 4)
        return row
    except Exception as exc:
        return {**row, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        rig.close()


# -- (c) cudaHostRegister cost --------------------------------------------------------------------------
def register_cost(gib: float, device: Any, repeats: int = 2) -> dict[str, Any]:
    """Pin and unpin a fresh /dev/shm mapping (what an engine does with the arena), seconds per GiB.

    The mapping is touched first (the engine populates the arena before pinning), so the figure is the
    registration itself; CPU (dry run): only the touch is timed."""
    import numpy as np
    from kvconnector import copy as kvcopy
    from kvconnector._torch_copy import pin_host, unpin_host

    gib = min(gib, 0.5 * shutil.disk_usage("/dev/shm").free / GIB)  # beside the server's arena
    size = int(gib * GIB) // mmap.PAGESIZE * mmap.PAGESIZE
    out: dict[str, Any] = {"gib": round(size / GIB, 3), "register_s_per_gib": [], "unregister_s_per_gib": []}
    with tempfile.TemporaryFile(dir="/dev/shm") as fh:
        fh.truncate(size)
        mm = mmap.mmap(fh.fileno(), size)
        try:
            t0 = time.perf_counter()
            view = np.frombuffer(mm, dtype=np.uint8)
            view[:: mmap.PAGESIZE] = 1
            del view
            out["touch_s_per_gib"] = round((time.perf_counter() - t0) / (size / GIB), 3)
            if device.type != "cuda":
                out["note"] = "no CUDA (dry run): registration not timed"
                return out
            addr = kvcopy.address_of(mm, writable=True)
            for _ in range(repeats):
                t0 = time.perf_counter()
                if not pin_host(addr, size):
                    out["error"] = "cudaHostRegister failed (see the warning above)"
                    return out
                t1 = time.perf_counter()
                unpin_host(addr)
                t2 = time.perf_counter()
                out["register_s_per_gib"].append(round((t1 - t0) / (size / GIB), 4))
                out["unregister_s_per_gib"].append(round((t2 - t1) / (size / GIB), 4))
        finally:
            mm.close()
    return out


# -- (d) copies on a side stream under a matrix product -----------------------------------------------------
class Burst:
    """`iters` matrix products queued on a stream of their own (CPU: run by a thread); elapsed seconds.

    Not on the stream the copier was registered on: its copies wait for the work queued there when
    they are issued (a save reads what the forward wrote), so products queued there first would run
    before the copies instead of beside them. In an engine the products beside a copy are the steps
    queued after it was issued."""

    def __init__(self, a: Any, b: Any, out: Any, iters: int) -> None:
        import torch

        self.device = a.device
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(self.device)
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # a and b were made there
            self.start = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self.stream):
                self.start.record()
                for _ in range(iters):
                    torch.matmul(a, b, out=out)
                self.end.record()
        else:
            self.seconds = 0.0
            self.thread = threading.Thread(target=self._cpu, args=(a, b, out, iters))
            self.thread.start()

    def _cpu(self, a: Any, b: Any, out: Any, iters: int) -> None:
        import torch

        t0 = time.perf_counter()
        for _ in range(iters):
            torch.matmul(a, b, out=out)
        self.seconds = time.perf_counter() - t0

    def done(self) -> bool:
        return bool(self.end.query()) if self.device.type == "cuda" else not self.thread.is_alive()

    def wait(self) -> float:
        if self.device.type == "cuda":
            self.end.synchronize()
            return float(self.start.elapsed_time(self.end)) / 1000
        self.thread.join()
        return self.seconds


def rel_diff(x: Any, ref: Any) -> float:
    """max |x - ref| / max |ref| (NaN counts as a difference of 1)."""
    d = float((x.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))
    return d if d == d else 1.0


def overlap(url: str, sz: Sizes, device: Any) -> dict[str, Any]:
    """Alternate products alone and products with save/load rounds on a side stream; the loads must
    stay bitwise exact and the products' results unchanged."""
    import torch

    case = next(c for c in CASES if c.name == "flash_attn")
    m = Model(sz.bw_layers, sz.heads, sz.head_dim, sz.latent, 16, sz.chunk, torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(sz.matmul_n, sz.matmul_n, device=device, dtype=torch.bfloat16, generator=gen)
    b = torch.randn(sz.matmul_n, sz.matmul_n, device=device, dtype=torch.bfloat16, generator=gen)
    ref, out = torch.empty_like(a), torch.empty_like(a)
    torch.matmul(a, b, out=ref)  # the same call as the bursts: same algorithm, same bits
    Burst(a, b, out, 2).wait()  # warm-up
    rig = make_rig(url, case, m, sz.bw_chunks, device)
    try:
        alone, loaded, rounds, equal, bitwise, diff = [], [], 0, True, True, 0.0
        for _ in range(3):
            alone.append(Burst(a, b, out, sz.matmul_iters).wait())
            burst = Burst(a, b, out, sz.matmul_iters)
            k = 0  # the copier issues on its own side stream (kvconnector._torch_copy.CudaStreams)
            while k == 0 or not burst.done():
                equal &= cycle(rig)[2]
                k += 1
            rounds += k
            loaded.append(burst.wait())
            bitwise &= bool(torch.equal(out, ref))
            diff = max(diff, rel_diff(out, ref))
        slow = [w / a_ for w, a_ in zip(loaded, alone, strict=True)]
        return {
            "copies_bitwise_equal": equal,
            "products_unchanged": diff <= 0.02,  # corruption is garbage; a reordered sum is not
            "products_bitwise_equal": bitwise,
            "products_max_rel_diff": diff,
            "copy_rounds": rounds,
            "bytes_per_round": 2 * rig.object_bytes,
            "products_alone_s": spread(alone),
            "products_with_copies_s": spread(loaded),
            "slowdown": spread(slow),
        }
    finally:
        rig.close()


# -- (e) a 16k-token prefix ----------------------------------------------------------------------------------
def prefix_load(url: str, sz: Sizes, device: Any) -> dict[str, Any]:
    """Save once, then load the whole prefix into GPU blocks `prefix_rounds` times (zeroed before each)."""
    import torch

    case = next(c for c in CASES if c.name == "flash_attn")
    m = Model(sz.bw_layers, sz.heads, sz.head_dim, sz.latent, 16, sz.chunk, torch.bfloat16)
    rig = make_rig(url, case, m, sz.prefix_tokens // sz.chunk, device)
    try:
        tokens = rig.fresh_tokens()
        save_s = save(rig, tokens)
        loads, equal = [], True
        for _ in range(sz.prefix_rounds):
            zero_dst(rig)
            sync(device)
            loads.append(load(rig, tokens))
            equal &= blocks_equal(rig)
        med = statistics.median(loads)
        return {
            "tokens": len(tokens),
            "layers": m.layers,
            "kv_heads": m.heads,
            "head_dim": m.head_dim,
            "bytes": rig.object_bytes,
            "pinned": rig.pinned,
            "save_s": round(save_s, 4),
            "load_s": spread(loads),
            "load_gbps": round(rig.object_bytes / med / 1e9, 2),
            "tokens_per_s": round(len(tokens) / med),
            "bitwise_equal": equal,
        }
    finally:
        rig.close()


# -- report -----------------------------------------------------------------------------------------------
def table(rows: list[list[str]]) -> str:
    """A markdown table (the first row is the header)."""
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(lines)


def render(report: dict[str, Any]) -> str:
    """The human-readable summary printed at the end (the JSON holds everything)."""
    parts = [f"device: {report['device']}  torch {report['torch']}  copy backend {report.get('copy_backend')}"]
    rt = report.get("roundtrip")
    if isinstance(rt, list):
        rows = [["layout", "dtype", "status", "bytes", "pinned"]]
        rows += [[r["layout"], r["dtype"], r["status"], str(r.get("bytes", "")), str(r.get("pinned", ""))] for r in rt]
        parts.append("(a) round trips through kvserver\n" + table(rows))
    bw = report.get("bandwidth")
    if isinstance(bw, dict) and "rows" in bw:
        rows = [["layout", "block", "load GB/s", "raw H2D", "ratio", "save GB/s", "raw D2H", "ratio"]]
        for r in bw["rows"]:
            if "error" in r:
                rows.append([r["layout"], str(r["block_size"]), "error: " + r["error"][:60], "", "", "", "", ""])
                continue
            rows.append(
                [r["layout"], str(r["block_size"]), _med(r["load_gbps"]), _med(r["raw_h2d_gbps"]), str(r["load_ratio"])]
                + [_med(r["save_gbps"]), _med(r["raw_d2h_gbps"]), str(r["save_ratio"])]
            )
        extra = f"worst: {bw['worst']} (goal >= {bw['goal_ratio']}); host checksum {bw['host_checksum_gbps']} GB/s"
        parts.append("(b) bandwidth, median [min-max] of alternated rounds\n" + table(rows) + "\n" + extra)
    for key, title in (("register", "(c) cudaHostRegister"), ("overlap", "(d) side stream"), ("prefix", "(e) prefix")):
        if key in report:
            parts.append(f"{title}: {json.dumps(report[key])}")
    parts.append(f"verdict: {report['verdict']}  ({report['seconds']} s)")
    return "\n\n".join(parts)


def _med(s: dict[str, float]) -> str:
    return f"{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]"


def verdict(report: dict[str, Any]) -> str:
    """ "pass" when every correctness check passed; timings never decide it."""
    rt, bw = report.get("roundtrip"), report.get("bandwidth", {})
    bad = [r["layout"] + "/" + r["dtype"] for r in rt if r.get("status") == "FAIL"] if isinstance(rt, list) else []
    bad += [r["layout"] for r in bw.get("rows", []) if r.get("bitwise_equal") is False or "error" in r]
    ov, pre = report.get("overlap", {}), report.get("prefix", {})
    if ov.get("copies_bitwise_equal") is False or ov.get("products_unchanged") is False:
        bad.append("overlap")
    if pre.get("bitwise_equal") is False:
        bad.append("prefix")
    bad += [k for k in report.get("steps", []) if _failed(report.get(k))]
    return "pass" if not bad else "FAIL: " + ", ".join(bad)


def _failed(section: Any) -> bool:
    """A step that raised, or never ran."""
    return section is None or (isinstance(section, dict) and "error" in section)


def write_out(report: dict[str, Any], out: Path | None) -> None:
    """JSON to `out` (a folder gets gpu_check.json and gpu_check.txt), rewritten after every step."""
    if out is None:
        return
    path = out / "gpu_check.json" if out.is_dir() else out
    path.write_text(json.dumps(report, indent=1, default=str))
    if out.is_dir() and "verdict" in report:
        (out / "gpu_check.txt").write_text(render(report) + "\n")


# -- main ---------------------------------------------------------------------------------------------------
STEPS: list[tuple[str, Callable[[str, Sizes, Any], Any]]] = [
    ("roundtrip", roundtrips),
    ("bandwidth", bandwidth),
    ("register", lambda _url, sz, device: register_cost(sz.register_gib, device)),
    ("overlap", overlap),
    ("prefix", prefix_load),
]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build (GPU run), start a kvserver, run every step within the time budget; the report."""
    t0 = time.monotonic()
    sz = Sizes.gpu() if (args.sizes or ("dry" if args.dry_run else "gpu")) == "gpu" else Sizes.dry()
    wanted = args.steps.split(",")
    report: dict[str, Any] = {"mode": "dry-run" if args.dry_run else "gpu", "sizes": asdict(sz), "steps": wanted}
    if args.build_ext or (not args.dry_run and not args.no_build):
        report["build"] = build_extension()
        print(f"build_ext: {report['build']}", flush=True)
    import torch
    from kvconnector import copy as kvcopy

    device = torch.device("cpu" if args.dry_run else "cuda")
    report["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)"
    report.update(torch=torch.__version__, copy_backend=kvcopy.backend_name(), python=sys.version.split()[0])
    l1 = l1_size_gb(sz.l1_gb)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp, kvserver(Path(tmp), l1, sz.chunk) as server:
        os.environ["KVSERVER_STATE_DIR"] = tmp  # the clients read the server's token file from there
        report["l1_gb"] = l1
        for name, step in [(n, f) for n, f in STEPS if n in wanted]:
            if time.monotonic() - t0 > args.budget_s:
                report[name] = {"error": f"skipped: the {args.budget_s:.0f} s budget was spent"}
                continue
            s0 = time.monotonic()
            try:
                report[name] = step(server.url, sz, device)
            except Exception as exc:
                report[name] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"{name}: {time.monotonic() - s0:.1f} s {json.dumps(report[name], default=str)[:400]}", flush=True)
            write_out(report, args.out)
    report["seconds"] = round(time.monotonic() - t0, 1)
    report["verdict"] = verdict(report)
    return report


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="the same steps on CPU tensors, small sizes (CI)")
    p.add_argument("--out", type=Path, help="a folder (gets gpu_check.json and .txt) or a .json file")
    p.add_argument("--no-build", action="store_true", help="GPU run: use the _kvcopy extension already built")
    p.add_argument("--build-ext", action="store_true", help="dry run: build the extension anyway (rehearsal)")
    p.add_argument("--budget-s", type=float, default=420.0, help="steps not started by then are skipped")
    p.add_argument("--steps", default=",".join(n for n, _ in STEPS), help="a comma-separated subset, in order")
    p.add_argument("--sizes", choices=("gpu", "dry"), help="override the sizes (default: dry with --dry-run)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed run still stops its kvserver
    if not args.dry_run:
        cuda_or_exit()
    report = run(args)
    write_out(report, args.out)
    print("\n" + render(report), flush=True)
    return 0 if report["verdict"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())

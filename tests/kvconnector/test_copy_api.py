"""The public copy module: backend choice, the forced fallback, and address helpers."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
from multiprocessing import shared_memory

import numpy as np
import pytest
import torch

from kvconnector import copy as kvcopy

_PROBE = (
    "import logging, sys; logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format='LOG %(message)s');"
    "{pre}from kvconnector import copy; print(copy.backend_name());"
    "print(copy.checksum_bytes(b'abcdefghijk'))"
)


def _probe(pre: str = "", **env: str) -> tuple[str, list[str], int]:
    full_env = {k: v for k, v in os.environ.items() if k != kvcopy.FORCE_FALLBACK_ENV} | env
    out = subprocess.run(
        [sys.executable, "-c", _PROBE.format(pre=pre)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=60,
        check=True,
    )
    name, value = out.stdout.split()
    logs = [line for line in out.stderr.splitlines() if line.startswith("LOG ") and "backend" in line]
    return name, logs, int(value)


def test_default_backend_is_the_extension():
    assert kvcopy.backend_name() == "cpp"  # uv sync builds it; a silent fallback here is a bug
    name, logs, value = _probe()
    assert name == "cpp" and logs == []
    assert value == kvcopy.checksum_bytes(b"abcdefghijk")


def test_env_var_forces_fallback_with_one_log_line():
    name, logs, value = _probe(**{kvcopy.FORCE_FALLBACK_ENV: "1"})
    assert name == "numpy-fallback"
    assert len(logs) == 1 and kvcopy.FORCE_FALLBACK_ENV in logs[0]
    assert value == kvcopy.checksum_bytes(b"abcdefghijk")  # same algorithm, same answer


def test_missing_extension_falls_back_with_one_warning():
    # A None entry in sys.modules makes `import kvconnector._kvcopy` raise ImportError for real.
    name, logs, _ = _probe(pre="sys.modules['kvconnector._kvcopy'] = None;")
    assert name == "numpy-fallback"
    assert len(logs) == 1 and "unavailable" in logs[0]


def test_address_of_numpy_torch_and_buffers():
    arr = np.arange(32, dtype=np.uint8)
    assert kvcopy.address_of(arr) == arr.ctypes.data
    assert kvcopy.address_of(arr[5:]) == arr.ctypes.data + 5
    t = torch.arange(16, dtype=torch.float32)
    assert kvcopy.address_of(t) == t.data_ptr()
    assert kvcopy.address_of(t[3:]) == t.data_ptr() + 12
    assert kvcopy.nbytes_of(t) == 64 and kvcopy.nbytes_of(arr) == 32

    ba = bytearray(b"x" * 100)
    assert kvcopy.nbytes_of(ba) == 100
    dst = kvcopy.address_of(ba, writable=True)
    src = kvcopy.address_of(arr)
    kvcopy.batch_copy(src, dst, np.array([[0, 10, 4]], dtype=np.int64))
    assert ba[8:16] == b"xx\x00\x01\x02\x03xx"

    with pytest.raises(ValueError):
        kvcopy.address_of(b"read only", writable=True)
    ro = np.zeros(4)
    ro.flags.writeable = False
    with pytest.raises(ValueError):
        kvcopy.address_of(ro, writable=True)
    with pytest.raises(TypeError):
        kvcopy.address_of(object())


def test_copy_into_mmap_and_shared_memory():
    payload = np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8)
    segs = np.array([[0, 100, 1000], [2000, 3000, 96]], dtype=np.int64)
    with mmap.mmap(-1, 8192) as mm:
        view = np.frombuffer(mm, dtype=np.uint8)
        kvcopy.batch_copy(kvcopy.address_of(payload), kvcopy.address_of(mm, writable=True), segs)
        assert np.array_equal(view[100:1100], payload[:1000])
        assert np.array_equal(view[3000:3096], payload[2000:2096])
        assert kvcopy.checksum(kvcopy.address_of(mm), 8192) == kvcopy.checksum_bytes(view)
        del view  # release the export before the mmap closes
    shm = shared_memory.SharedMemory(create=True, size=4096)
    try:
        base = kvcopy.address_of(shm.buf, writable=True)
        kvcopy.batch_copy(kvcopy.address_of(payload), base, np.array([[7, 0, 4089]], dtype=np.int64))
        assert bytes(shm.buf[:4089]) == payload[7:].tobytes()
    finally:
        shm.close()
        shm.unlink()


def test_default_threads_reported():
    assert 1 <= kvcopy.default_threads() <= 8

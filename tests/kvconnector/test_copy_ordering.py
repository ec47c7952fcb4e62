"""The CUDA path's ordering, behind the `CopyStreams` interface, with a recording fake (#35 item 4).

The torch copier issues its copies on a side stream and `finish` waits for that stream's completion
event. What must never happen: a load's leases released (the server may then reuse the bytes the
copy still reads) or a save committed (the server would publish a half-written object) while a copy
issued before it has not completed, also when a copy raised half-way. A real kvserver, the real
EngineClient and the real TorchCopier on CPU tensors; only the streams are the recording fake, and
the link's sends are recorded in the same log.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import numpy as np
import pytest

from engine_kv_helpers import Geometry, module_server
from kvconnector._torch_copy import HostPins, TorchCopier
from kvconnector.engine_client import EngineClient
from kvtestkit.kvhelpers import sid

kv_server = module_server("--l1-size-gb", "0.1", "--chunk-size", "64", "--lease-ttl", "30")
_seeds = itertools.count(1)
GUARDED = {"release", "commit", "abort"}  # what the server acts on as "the copy is over"


class RecordingStreams:
    """Logs each copy's issue and each wait for completion; `fail_after` raises out of that issue."""

    def __init__(self, log: list[str], fail_after: int | None = None) -> None:
        self.log = log
        self.fail_after = fail_after
        self.issued = 0

    @contextlib.contextmanager
    def issue(self) -> Iterator[None]:
        self.log.append("issue")
        yield
        self.issued += 1
        if self.fail_after is not None and self.issued >= self.fail_after:
            raise RuntimeError("a copy failed on the device")

    def complete(self) -> None:
        self.log.append("complete")


def recorded_client(server, geo: Geometry, kv, log: list[str], fail_after: int | None = None) -> EngineClient:
    """An EngineClient whose torch copier issues on recording streams and whose sends are logged."""
    c = EngineClient(server.url, "test/model", 1, 0, [geo.layout()], mode="shm", copy_backend="torch")
    assert c.register(kv)
    copier = c._plane.copier
    assert isinstance(copier, TorchCopier)
    copier.streams = RecordingStreams(log, fail_after)
    link = c._plane.link
    send = link.server.send

    def logged(req, deadline, frames=()):
        log.append(req.op_name())
        return send(req, deadline, frames)

    link.server.send = logged  # type: ignore[method-assign]
    return c


def assert_ordered(log: list[str]) -> None:
    """No guarded send while an issued copy has not been waited for."""
    pending = False
    for i, entry in enumerate(log):
        if entry == "issue":
            pending = True
        elif entry == "complete":
            pending = False
        elif entry in GUARDED:
            assert not pending, f"{entry} sent before its copy completed: {log[: i + 1]}"


def tokens(n: int) -> np.ndarray:
    return np.random.default_rng(next(_seeds) * 104_729).integers(0, 50_000, n)


def test_saves_commit_and_loads_release_only_after_their_copies_complete(kv_server) -> None:
    geo = Geometry("flash_attn")
    log: list[str] = []
    prompt = tokens(4 * 64)
    with (
        recorded_client(kv_server, geo, geo.random_kv(24, seed=1), log) as a,
        recorded_client(kv_server, geo, geo.sentinel_kv(24), log) as b,
    ):
        assert a.save(prompt, list(range(16))).saved_chunks == 4
        assert b.lookup(prompt, session=sid("order")).hit_tokens == 256
        assert b.load(sid("order"), prompt, list(range(8, 24)), skip_tokens=0, num_tokens=256).ok
    assert log.count("commit") == 1 and log.count("release") >= 1 and log.count("issue") >= 2
    assert_ordered(log)


def test_a_copy_that_raises_is_still_awaited_before_the_release_or_abort(kv_server) -> None:
    geo = Geometry("flash_attn")
    prompt = tokens(2 * 64)
    with recorded_client(kv_server, geo, geo.random_kv(12, seed=2), []) as writer:
        assert writer.save(prompt, list(range(8))).saved_chunks == 2
    log: list[str] = []
    with recorded_client(kv_server, geo, geo.sentinel_kv(12), log, fail_after=1) as reader:
        assert reader.lookup(prompt, session=sid("raise")).hit_tokens == 128
        res = reader.load(sid("raise"), prompt, list(range(8)), skip_tokens=0, num_tokens=128)
        assert not res.ok  # the load failed: its blocks are recomputed
        assert reader.save(tokens(2 * 64), list(range(8))).saved_chunks == 0  # the save's copy raised too
    assert "release" in log and "abort" in log
    assert log.index("complete") < log.index("release")
    assert_ordered(log)


def test_the_arena_is_registered_once_per_process_and_unregistered_by_its_last_user() -> None:
    calls: list[tuple[str, int]] = []
    pins = HostPins(
        register=lambda a, n: calls.append(("register", a)), unregister=lambda a: calls.append(("unregister", a))
    )
    assert pins.pin(4096, 1 << 20) and pins.pin(4096, 1 << 20)  # the step's client and the loader's
    assert calls == [("register", 4096)] and pins.users(4096) == 2
    pins.unpin(4096)
    assert calls == [("register", 4096)]  # the other copier still copies through it
    pins.unpin(4096)
    pins.unpin(4096)  # one unpin too many changes nothing
    assert calls == [("register", 4096), ("unregister", 4096)] and pins.users(4096) == 0


def test_a_failed_registration_is_not_counted_and_copies_stay_correct() -> None:
    def refuse(addr: int, size: int) -> None:
        raise RuntimeError("cudaErrorHostMemoryAlreadyRegistered")

    pins = HostPins(register=refuse, unregister=lambda a: pytest.fail("nothing was registered"))
    assert not pins.pin(8192, 4096)
    pins.unpin(8192)
    assert pins.users(8192) == 0


def test_the_connector_config_picks_the_copier_and_refuses_unknown_ones() -> None:
    from kvconnector.vllm.config import parse_config

    assert parse_config({}).copy_backend == "auto"  # GPU KV: the CUDA copier; host KV: the C++ kernel
    assert parse_config({"copy_backend": "torch"}).copy_backend == "torch"
    with pytest.raises(ValueError, match="copy_backend must be one of"):
        parse_config({"copy_backend": "cuda"})

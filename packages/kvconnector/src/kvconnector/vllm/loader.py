"""Asynchronous loads and saves: copies that run on background threads while the engine steps.

Why: a long load inside the step stalls the decode of every other running request. vLLM's async
path parks the loading request in WAITING_FOR_REMOTE_KVS and polls `get_finished` each step; the
copy itself runs here, on an EngineClient of its own (so the step's calls never wait on its lock).
The copy kernels release the GIL. EngineClient.load keeps its contract on this thread: it ends this
rank's leases itself and fails unless the server confirms they were held through the copy.
Loads and saves run on a thread each, with a client each: a request waiting for its prefix must not
queue behind the saves of the requests that ran before it (a busy engine submits a save per
finished chunk, every step). Streamed L2 hits get a third thread and client where the connector
streams them: such a load lasts as long as the server's prefetch from L2, and the L1 hits of the
requests after it must not wait that long. Results are handed back to the engine thread, which
alone touches vLLM-facing state.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .jobs import LoadJob, SaveJob

if TYPE_CHECKING:
    from ..engine_client import EngineClient


@dataclass(frozen=True, slots=True)
class LoadOutcome:
    ok: bool
    loaded_tokens: int
    seconds: float
    error: str | None = None
    failed_block_ids: list[int] = field(default_factory=list)
    verify_failures: int = 0


def load_end(client: EngineClient, job: LoadJob) -> int:
    """Where a load ends: the chunk end, or for a sliding window exactly the first token vLLM computes,
    so the window written is the one vLLM attends to (never a block it replaced by its null block)."""
    if any(lay.kind == "sliding" for lay in client.layouts) and job.compute_from > job.skip_tokens:
        return min(job.compute_from, job.num_tokens)
    return job.num_tokens


def copy_job(client: EngineClient, job: LoadJob, wanted: list[int], delay_s: float = 0.0) -> LoadOutcome:
    """One load through `client`; never raises (a failed load is recomputed, never an engine error)."""
    t = time.perf_counter()
    if delay_s > 0:
        time.sleep(delay_s)  # TEST ONLY (debug_load_delay_s): a slow load on purpose
    before = client.verify_failures
    try:
        load = client.load_streamed if job.stream else client.load
        res = load(
            job.session,
            job.tokens,
            job.block_ids,
            skip_tokens=job.skip_tokens,
            num_tokens=load_end(client, job),
            salt=job.salt,
            extra=job.extra,
        )
        out = LoadOutcome(res.ok, res.loaded_tokens, 0.0, res.error, list(res.failed_block_ids))
    except Exception as exc:  # noqa: BLE001 - load already gave this rank's leases back
        out = LoadOutcome(False, 0, 0.0, f"{type(exc).__name__}: {exc}", wanted)
    return LoadOutcome(
        out.ok,
        out.loaded_tokens,
        time.perf_counter() - t,
        out.error,
        out.failed_block_ids,
        client.verify_failures - before,
    )


@dataclass(frozen=True, slots=True)
class SaveOutcome:
    ok: bool
    chunks: int
    seconds: float
    error: str | None = None
    no_space: bool = False  # also: a reservation the server could not admit within reserve_wait_s


def save_job(
    client: EngineClient,
    job: SaveJob,
    delay_s: float = 0.0,
    reserve_wait_s: float = 0.0,
    released: threading.Event | None = None,
) -> SaveOutcome:
    """One save through `client`; never raises (a failed store is a future miss). A reserved save
    the server cannot admit yet (RETRY_LATER: other requests fill L1) is retried for reserve_wait_s."""
    t = time.perf_counter()
    if delay_s > 0:  # TEST ONLY (debug_save_delay_s): a slow save on purpose, held until `released`
        (released or threading.Event()).wait(delay_s)
    try:
        kw: dict[str, Any] = {"tail": True} if job.tail else {}
        if job.reservation is not None:
            kw = {"reservation": job.reservation, "total_chunks": job.total_chunks}
        while True:
            res = client.save(
                job.tokens, job.block_ids, salt=job.salt, skip_tokens=job.skip_tokens, extra=job.extra, **kw
            )
            if not getattr(res, "retry_later", False) or time.perf_counter() - t >= reserve_wait_s:
                break
            time.sleep(0.02)
        busy = res.no_space or getattr(res, "retry_later", False)  # the server works; the cache is full or busy
        return SaveOutcome(res.ok, res.saved_chunks, time.perf_counter() - t, res.error, busy)
    except Exception as exc:  # noqa: BLE001
        return SaveOutcome(False, 0, time.perf_counter() - t, f"{type(exc).__name__}: {exc}")


class BackgroundLoader:
    """Runs loads in submission order on one thread and saves in submission order on another;
    with a `stream_client`, streamed loads (`LoadJob.stream`) in submission order on a third.

    `save_client` None: saves share the load client (its lock then orders a load after a save call
    that is running, never after queued ones). `stream_client` None: streamed loads queue with the
    others. `hold_saves_for_load` (TEST ONLY): a save held by `save_delay_s` is released as soon as
    a load ends, so a test can tell which ended first."""

    def __init__(
        self,
        client: EngineClient,
        delay_s: float = 0.0,
        save_delay_s: float = 0.0,
        reserve_wait_s: float = 0.0,
        save_client: EngineClient | None = None,
        hold_saves_for_load: bool = False,
        stream_client: EngineClient | None = None,
    ) -> None:
        self.client = client
        self.save_client = save_client if save_client is not None else client
        self.stream_client = stream_client
        self.reserve_wait_s = reserve_wait_s
        self.delay_s = delay_s
        self.save_delay_s = save_delay_s
        self._loads = ThreadPoolExecutor(1, thread_name_prefix="kvserver-load")
        self._saves = ThreadPoolExecutor(1, thread_name_prefix="kvserver-save")
        self._streams = ThreadPoolExecutor(1, thread_name_prefix="kvserver-stream") if stream_client else None
        self._jobs: list[tuple[Any, Future[Any]]] = []
        self._past_saves = 0  # loads that ended while a save submitted before them still ran
        self._lock = threading.Lock()  # _past_saves is counted on the load thread, taken on the engine's
        self._load_ended = threading.Event() if hold_saves_for_load else None

    def clients(self) -> list[EngineClient]:
        """The distinct clients of the threads (each registers the KV tensors)."""
        out = [self.client] if self.save_client is self.client else [self.client, self.save_client]
        return out + ([self.stream_client] if self.stream_client is not None else [])

    def submit(self, job: LoadJob, wanted: list[int]) -> None:
        earlier = [f for j, f in self._jobs if isinstance(j, SaveJob) and not f.done()]
        if job.stream and self._streams is not None and self.stream_client is not None:
            f = self._streams.submit(copy_job, self.stream_client, job, wanted, self.delay_s)
        else:
            f = self._loads.submit(copy_job, self.client, job, wanted, self.delay_s)
        f.add_done_callback(lambda _: self._load_done(earlier))
        self._jobs.append((job, f))

    def _load_done(self, earlier: list[Future[Any]]) -> None:
        """On the load thread, as the load ends: did a save submitted before it still run?"""
        if any(not f.done() for f in earlier):
            with self._lock:
                self._past_saves += 1
        if self._load_ended is not None:
            self._load_ended.set()

    def take_loads_past_saves(self) -> int:
        """Loads that ended while a save submitted before them still ran, since the last call."""
        with self._lock:
            n, self._past_saves = self._past_saves, 0
        return n

    def submit_save(self, job: SaveJob) -> None:
        f = self._saves.submit(
            save_job, self.save_client, job, self.save_delay_s, self.reserve_wait_s, self._load_ended
        )
        self._jobs.append((job, f))

    def in_flight(self) -> int:
        return len(self._jobs)

    def loads_in_flight(self) -> int:
        return sum(isinstance(job, LoadJob) for job, _ in self._jobs)

    def wait_saves(self) -> None:
        """Block until every save submitted so far has ended (their blocks may be reused next)."""
        for job, f in list(self._jobs):
            if isinstance(job, SaveJob):
                f.result()

    def wait_any(self, timeout: float) -> None:
        """Block until some job ended or `timeout` passed (an idle engine's step yields to the copies)."""
        if self._jobs:
            wait([f for _, f in self._jobs], timeout, return_when=FIRST_COMPLETED)

    def take_done(self) -> list[tuple[Any, Any]]:
        done: list[tuple[Any, Any]] = []
        left: list[tuple[Any, Future[Any]]] = []
        for job, f in self._jobs:
            if not f.done():
                left.append((job, f))
                continue
            done.append((job, f.result()))
        self._jobs = left
        return done

    def close(self) -> None:
        self._loads.shutdown(wait=True)  # a copy into engine blocks must end before they are freed
        self._saves.shutdown(wait=True)
        if self._streams is not None:
            self._streams.shutdown(wait=True)
        for client in self.clients():
            client.close()

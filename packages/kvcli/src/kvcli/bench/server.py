"""`kvcli bench server`: drive a running kvserver over its real protocol like an engine would.

Per request: lookup (leases the hit prefix), retrieve the hit chunks, store + fill + commit the
rest, end the session. Latencies are per operation including the data movement, so store and
retrieve figures are what an engine would see.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from kvprotocol import Client, KeySpace, RequestTimeout, ServerError, chunk_hashes, flows, new_session_id, pack_tokens
from kvprotocol import replies as rp
from kvprotocol import requests as rq
from kvprotocol.kvsum import kvsum64

from .kvshape import KVShape
from .stats import Latencies, gbps
from .transport import Arena, Payload, frames_to_arrays
from .workloads import Request, WorkloadSpec, generate

R = TypeVar("R", bound=rp.Reply_)  # the reply Struct a typed request gets

OPS = ("lookup", "retrieve", "store")


class BenchAborted(Exception):
    """The run cannot go on (server gone, shape refused); str() says why."""


@dataclass
class Tally:
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    stored_bytes: int = 0
    retrieved_bytes: int = 0
    stored_objects: int = 0
    retrieved_objects: int = 0
    deduplicated: int = 0
    no_space: int = 0
    verify_errors: int = 0
    errors: dict[str, int] = field(default_factory=dict)


@dataclass
class ServerBench:
    url: str
    spec: WorkloadSpec
    shape: KVShape
    mode: str = "tcp"
    model: str = "bench-model"
    salt: str | None = None  # None: a fresh salt per run, so runs never reuse each other's objects
    duration: float = 0.0  # seconds; 0 = until the workload ends
    verify: bool = False
    timeout: float = 30.0
    lat: Latencies = field(default_factory=Latencies)
    tally: Tally = field(default_factory=Tally)

    def run(self, on_request: Callable[[int], None] = lambda n: None) -> dict[str, Any]:
        if self.mode not in ("tcp", "shm"):
            raise ValueError("mode must be tcp or shm")
        salt = self.salt if self.salt is not None else f"bench-{secrets.token_hex(6)}"
        from .._auth import cli_token

        with Client(self.url, timeout=self.timeout, token=cli_token()) as client:
            chunk_size = int(self._call(client, "describe").result["config"]["chunk_size"])
            layout = self.shape.layout(chunk_size)
            reg = self._call(
                client,
                "register_engine",
                model=self.model,
                world_size=1,
                rank=0,
                groups=[layout.to_wire()],
                host=socket.gethostname(),
                pid=os.getpid(),
            ).result
            keyspace = KeySpace(self.model, 1, (layout.fingerprint,)).wire()
            arena = Arena(reg["arena"]["name"], reg["arena"]["size"]) if self.mode == "shm" else None
            payload = Payload(layout.object_bytes, self.spec.seed)
            sink = np.empty(layout.object_bytes, dtype=np.uint8)
            started = time.perf_counter()
            try:
                for n, req in enumerate(generate(self.spec)):
                    if self.duration and time.perf_counter() - started >= self.duration:
                        break
                    self._one(client, arena, payload, sink, keyspace, salt, chunk_size, req, n)
                    on_request(n + 1)
            finally:
                if arena is not None:
                    arena.close()
            elapsed = time.perf_counter() - started
        return self.report(elapsed, chunk_size)

    def _call(self, client: Client, op: str, frames: list[Any] | tuple[()] = (), **fields: Any) -> Any:
        try:
            return client.call(op, frames=frames, **fields)
        except RequestTimeout as exc:
            raise BenchAborted(f"timeout: {exc}") from None
        except ServerError as exc:
            if op in ("describe", "register_engine"):
                raise BenchAborted(f"{op} refused: {exc.code}: {exc.message}") from None
            raise

    def _send(self, client: Client, req: rq.Request[R], frames: Any = ()) -> tuple[R, list[memoryview]]:
        try:
            return client.send(req, frames)
        except RequestTimeout as exc:
            raise BenchAborted(f"timeout: {exc}") from None

    def _one(
        self,
        client: Client,
        arena: Arena | None,
        payload: Payload,
        sink: np.ndarray,
        keyspace: rq.KeySpaceW,
        salt: str,
        chunk_size: int,
        req: Request,
        n: int,
    ) -> None:
        tokens = pack_tokens(req.tokens)
        hashes = chunk_hashes(req.tokens, chunk_size)
        session = new_session_id()  # 128 random bits: the server refuses guessable session ids
        common: dict[str, Any] = {"keyspace": keyspace, "tokens": tokens, "salt": salt}
        t = self.tally
        t.requests += 1
        t.prompt_tokens += len(req.tokens)
        try:
            t0 = time.perf_counter()
            hit = self._send(client, rq.Lookup(session=session, **common))[0]
            self.lat.add("lookup", time.perf_counter() - t0)
            t.hit_tokens += hit.hit_tokens
            if hit.hit_chunks:
                self._retrieve(client, arena, payload, sink, session, hashes, hit.hit_chunks)
            if hit.hit_chunks < len(hashes):
                self._store(client, arena, payload, session, common, hashes, hit.hit_chunks)
        except ServerError as exc:
            t.errors[str(exc.code)] = t.errors.get(str(exc.code), 0) + 1
        finally:
            try:
                self._call(client, "end_session", session=session)
            except ServerError as exc:
                t.errors[str(exc.code)] = t.errors.get(str(exc.code), 0) + 1

    def _retrieve(
        self,
        client: Client,
        arena: Arena | None,
        payload: Payload,
        sink: np.ndarray,
        session: str,
        hashes: list[bytes],
        end: int,
    ) -> None:
        t0 = time.perf_counter()
        mode: rq.Mode = "shm" if arena is not None else "tcp"
        req = rq.Retrieve(session=session, rank=0, start_chunk=0, end_chunk=end, mode=mode)
        reply, frames = flows.retrieve_leased(lambda r, f: self._send(client, r, f), req)
        objects = reply.objects
        if arena is None:
            datas = frames_to_arrays(frames)
            for data in datas:
                np.copyto(sink[: data.size], data)  # what an engine's scatter would copy
        else:
            for obj in objects:
                arena.read_into(obj.offset or 0, sink[: obj.size])  # shm replies carry offsets
        self.lat.add("retrieve", time.perf_counter() - t0)
        if arena is None:
            ok = [payload.check(d, hashes[o.chunk], self.verify) for o, d in zip(objects, datas, strict=True)]
        else:
            ok = []
            for obj in objects:  # shm: re-read each for the check (outside the timed section)
                arena.read_into(obj.offset or 0, sink[: obj.size])
                ok.append(payload.check(sink[: obj.size], hashes[obj.chunk], self.verify))
        self.tally.verify_errors += ok.count(False)
        self.tally.retrieved_objects += len(objects)
        self.tally.retrieved_bytes += sum(o.size for o in objects)

    def _store(
        self,
        client: Client,
        arena: Arena | None,
        payload: Payload,
        session: str,
        common: dict[str, Any],
        hashes: list[bytes],
        start: int,
    ) -> None:
        t = self.tally
        t0 = time.perf_counter()

        def fill(_reply: rp.StoreReply, reserved: list[rp.StoreSlot]) -> tuple[list[Any], list[int]]:
            frames, checksums = [], []
            for slot in reserved:
                data = payload.make(hashes[slot.chunk])
                checksums.append(kvsum64(data))  # the commit proves the write (what an engine's gather computes)
                if arena is None:
                    frames.append(data)
                else:
                    assert slot.offset is not None
                    arena.write(slot.offset, data)
            return frames, checksums

        mode: rq.Mode = "shm" if arena is not None else "tcp"
        req = rq.Store(rank=0, start_chunk=start, mode=mode, session=session, **common)
        reply = flows.store_and_commit(lambda r, f: self._send(client, r, f), req, fill)
        self.lat.add("store", time.perf_counter() - t0)
        reserved = [s for s in reply.slots if s.status == "reserved"]
        t.stored_objects += len(reserved)
        t.stored_bytes += sum(s.size or 0 for s in reserved)
        t.deduplicated += sum(s.status in ("present", "writing") for s in reply.slots)
        t.no_space += sum(s.status == "no_space" for s in reply.slots)

    def report(self, elapsed: float, chunk_size: int) -> dict[str, Any]:
        t, lat = self.tally, self.lat
        moved = t.stored_bytes + t.retrieved_bytes
        return {
            "target": self.url,
            "mode": self.mode,
            "workload": self.spec.name,
            "spec": {
                "users": self.spec.users,
                "rounds": self.spec.rounds,
                "context_tokens": self.spec.context_tokens,
                "question_tokens": self.spec.question_tokens,
                "answer_tokens": self.spec.answer_tokens,
                "seed": self.spec.seed,
                "duration_limit_s": self.duration or None,
            },
            "kv_shape": self.shape.describe(chunk_size),
            "requests": t.requests,
            "duration_s": round(elapsed, 4),
            "prompt_tokens": t.prompt_tokens,
            "hit_tokens": t.hit_tokens,
            "token_hit_rate": round(t.hit_tokens / t.prompt_tokens, 4) if t.prompt_tokens else None,
            "latency_ms": lat.summary(OPS),
            "throughput_gbps": {
                "store": gbps(t.stored_bytes, lat.total("store")),
                "retrieve": gbps(t.retrieved_bytes, lat.total("retrieve")),
                "overall": gbps(moved, elapsed),
            },
            "bytes": {"stored": t.stored_bytes, "retrieved": t.retrieved_bytes},
            "objects": {
                "stored": t.stored_objects,
                "retrieved": t.retrieved_objects,
                "deduplicated": t.deduplicated,
                "no_space": t.no_space,
            },
            "verify_errors": t.verify_errors,
            "errors": dict(t.errors),
        }

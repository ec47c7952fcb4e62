"""One soak client process: the ranks of one engine (EngineClients in this process, sharing lookup
sessions as TP ranks do) storing, looking up and loading workload prompts, checking every loaded
block, and logging each op as a JSON line. SIGUSR1 (SIGUSR2) makes its next save kill (stop) the process
mid-write; SIGTERM ends it after the current op.

Run by the soak: `python -m bench.soak.worker SPEC_JSON`."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import IO, Any

import numpy as np
import torch

from bench.soak.workload import (
    BLOCK,
    CHUNK,
    MAX_BLOCKS,
    MODEL,
    PREFIXES,
    SENTINEL,
    SUFFIX_CHUNKS,
    SUFFIXES,
    LAYERS,
    Identity,
    layer_shape,
    layout,
    prompt,
)
from kvconnector.engine_client import EngineClient
from kvprotocol import new_session_id


@dataclass(frozen=True)
class Spec:
    name: str
    url: str
    token: str
    tenant: str
    tag: str
    world: int
    mode: str
    slow: bool
    seed: int
    deadline: float
    events: str
    lease_ttl: float


def error_code(error: str | None) -> str:
    """A stable code from an EngineClient error string ('server:NO_SPACE: ...' -> 'NO_SPACE')."""
    if not error:
        return "none"
    head, _, rest = error.partition(":")
    if head == "server":
        return rest.strip().split(":")[0].strip() or "server"
    return head.strip().split(" ")[0] or "unknown"


class Worker:
    def __init__(self, spec: Spec, out: IO[str]) -> None:
        self.spec, self.out = spec, out
        self.rng = np.random.default_rng(spec.seed)
        self.ranks = [Identity(spec.tenant, spec.tag, spec.world, r) for r in range(spec.world)]
        shape = layer_shape(spec.tag, 2 * MAX_BLOCKS)  # blocks [0, MAX) are saved from, [MAX, 2 MAX) loaded into
        self.kv = [[torch.full(shape, SENTINEL) for _ in range(LAYERS)] for _ in range(spec.world)]
        self.clients = [
            EngineClient(
                spec.url, MODEL, spec.world, r, [layout(spec.tag)], mode=spec.mode, timeout=3.0, token=spec.token
            )
            for r in range(spec.world)
        ]
        for client, kv in zip(self.clients, self.kv, strict=True):
            client.register(kv)
        self.in_save_signal: int | None = None  # raised inside the next save's copy (a fault)
        self.stopping = False
        # the fault signals are handled before the conductor hears "ready": it sends them only then
        signal.signal(signal.SIGUSR1, lambda *_: setattr(self, "in_save_signal", signal.SIGKILL))
        signal.signal(signal.SIGUSR2, lambda *_: setattr(self, "in_save_signal", signal.SIGSTOP))
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))  # the run's end: finish this op
        open(spec.events + ".ready", "w").close()  # the conductor starts its clock once every client is here

    def log(self, op: str, t0: float, ok: bool, error: str | None = None, **extra: Any) -> None:
        ms = (time.time() - t0) * 1000
        line = {"w": self.spec.name, "op": op, "t": t0, "ms": round(ms, 3), "ok": ok, "code": error_code(error)}
        self.out.write(json.dumps({**line, **extra}) + "\n")
        self.out.flush()

    def step(self) -> None:
        prefix, suffix = int(self.rng.integers(PREFIXES)), int(self.rng.integers(SUFFIXES))
        if self.in_save_signal is not None:  # a mid-write fault is armed: a fresh suffix makes this step save
            suffix = SUFFIXES + int(self.rng.integers(1 << 30))
        tokens = prompt(prefix, suffix, int(self.rng.integers(1, SUFFIX_CHUNKS + 1)))
        full = len(tokens) // CHUNK * CHUNK
        session = new_session_id()
        t0 = time.time()
        found = self.clients[0].lookup(tokens, session=session)
        self.log("lookup", t0, found.error is None, found.error, hit=found.hit_tokens)
        if found.hit_tokens:
            if self.spec.slow:  # hold the leases past their TTL, then load anyway
                time.sleep(self.spec.lease_ttl * float(self.rng.uniform(0.5, 1.5)))
            for ident, client, kv in zip(self.ranks, self.clients, self.kv, strict=True):
                self.load(ident, client, kv, session, tokens, found.hit_tokens)
        if found.hit_tokens < full:
            for ident, client, kv in zip(self.ranks, self.clients, self.kv, strict=True):
                self.save(ident, client, kv, tokens, full)

    def load(
        self, ident: Identity, client: EngineClient, kv: list[torch.Tensor], session: str, tokens: Any, hit: int
    ) -> None:
        for layer in kv:  # the load region back to the sentinel (the save region keeps its content)
            view = layer[:, MAX_BLOCKS:] if self.spec.tag == "flash_attn" else layer[MAX_BLOCKS:]
            view.fill_(SENTINEL)
        blocks = list(range(MAX_BLOCKS, MAX_BLOCKS + len(tokens) // BLOCK))
        t0 = time.time()
        res = client.load(session, tokens, blocks, 0, hit)
        if not res.ok:
            self.log("load", t0, False, res.error)
            return
        wrong = ident.wrong_blocks(kv, tokens, hit // CHUNK, MAX_BLOCKS)
        self.log("load", t0, True, None, hit=hit, wrong=wrong)

    def save(self, ident: Identity, client: EngineClient, kv: list[torch.Tensor], tokens: Any, full: int) -> None:
        ident.fill(kv, tokens, full // CHUNK, 0)
        _hook_gather(client, self)
        t0 = time.time()
        res = client.save(tokens, list(range(full // BLOCK)))
        self.log("save", t0, res.ok, res.error, chunks=res.saved_chunks)

    def run(self) -> None:
        while time.time() < self.spec.deadline and not self.stopping:
            self.step()
            time.sleep(float(self.rng.uniform(0.0, 0.05)))
        for client in self.clients:
            client.close()


def _hook_gather(client: EngineClient, worker: Worker) -> None:
    """Wrap the copier's gather (the copy into the reserved slots, between reserve and commit) so an
    armed fault signal lands exactly mid-write: SIGKILL dies holding the reservation; SIGSTOP resumes
    after the hold and copies into slots whose reservation (and quarantine) may have ended."""
    copier = client._plane.copier
    if copier is None or getattr(copier.gather, "soak_hook", False):
        return
    original = copier.gather

    def gather(*args: Any) -> Any:
        sig, worker.in_save_signal = worker.in_save_signal, None
        if sig is not None:
            os.kill(os.getpid(), sig)
        return original(*args)

    gather.soak_hook = True  # type: ignore[attr-defined]
    copier.gather = gather  # type: ignore[method-assign, assignment]


def main() -> None:
    torch.set_num_threads(1)
    spec = Spec(**json.loads(sys.argv[1]))
    with open(spec.events, "a") as out:
        Worker(spec, out).run()


if __name__ == "__main__":
    main()

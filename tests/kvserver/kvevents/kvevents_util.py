"""Helpers for the KV-events tests: a server publishing events, a router-like block index, joining a stream."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from kvtestkit.kvhelpers import payload, store, tiny_layout
from kvprotocol import Client, KeySpace, resolve_token
from kvtestkit.kvsub import Batch, Subscriber, replay
from kvtestkit.ports import with_fresh_ports
from kvtestkit.serverproc import ServerProc, free_port

CHUNK = 256
PROBE = 900_000  # token ids of the sync probes
_probes = itertools.count()  # each probe a new chunk, so each one publishes


@dataclass
class EventServer:
    proc: ServerProc
    endpoint: str
    replay_endpoint: str

    @property
    def plain(self) -> tuple[str, str]:
        """The PLAIN credentials the event sockets take: user kvserver, the server's token."""
        token = resolve_token(self.proc.token, self.proc.url)
        assert token
        return ("kvserver", token)

    def subscriber(self, **kw: Any) -> Subscriber:
        return Subscriber(self.endpoint, **{"plain": self.plain, **kw})

    def replay(self, start: int, **kw: Any) -> list[Batch]:
        return replay(self.replay_endpoint, start, **{"plain": self.plain, **kw})


@dataclass
class BlockIndex:
    """What a router would know of one medium (L1 by default): the blocks announced and not yet removed.

    The same block is announced once per medium that holds it (an L2 tier's write-behind announces
    an L1 block again, as `kvserver_l2_fs`), so each medium needs an index of its own."""

    blocks: dict[bytes | int, dict[str, Any]] = field(default_factory=dict)
    seqs: list[int] = field(default_factory=list)
    medium: str = "kvserver_l1"

    def apply(self, batches: list[Batch]) -> None:
        for b in batches:
            self.seqs.append(b.seq)
            for ev in b.events:
                if ev.get("medium", self.medium) != self.medium:
                    continue
                if ev["type"] == "BlockStored":
                    for h in ev["block_hashes"]:
                        assert h not in self.blocks, "a block announced twice without a removal between"
                        self.blocks[h] = ev
                elif ev["type"] == "BlockRemoved":
                    for h in ev["block_hashes"]:
                        assert h in self.blocks, "removal of a block never announced"
                        del self.blocks[h]
                else:
                    assert ev == {"type": "AllBlocksCleared"}
                    self.blocks.clear()


def start_event_server(server_factory: Any, *args: str) -> EventServer:
    def start() -> EventServer:
        endpoint, replay_endpoint = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        proc = server_factory(
            "--kv-events-endpoint",
            endpoint,
            "--kv-events-replay-endpoint",
            replay_endpoint,
            "--kv-events-topic",
            "kv@test@{model}",
            *args,
        )
        return EventServer(proc, endpoint, replay_endpoint)

    return with_fresh_ports(start)


def _has_probe(batches: list[Batch], i: int) -> bool:
    return any(ev["type"] == "BlockStored" and ev["token_ids"][0] == PROBE + i for b in batches for ev in b.events)


def sync(
    sub: Subscriber, c: Client, ks: KeySpace, replay_endpoint: str, plain: tuple[str, str] | None = None, start: int = 0
) -> list[Batch]:
    """Every batch from seq `start` on, with `sub` live from here on: the way a router (re)joins a publisher.

    Probe chunks are stored until the subscription delivers (ZMQ's slow joiner), then what the live
    stream missed is fetched from the replay socket and the two are joined at the first live seq.
    """
    size = tiny_layout().object_bytes
    for _ in range(200):
        i = next(_probes)
        store(c, ks, [PROBE + i] * CHUNK, lambda ch, g, seed=i: payload(seed, size))
        first = sub.recv(timeout_ms=100)
        if first is None:
            continue
        live = [first]
        live += sub.recv_until(lambda bs, head=live, probe=i: _has_probe(head + bs, probe))
        missed = [b for b in replay(replay_endpoint, start, plain=plain) if b.seq < first.seq]
        batches = missed + live
        assert [b.seq for b in batches] == list(range(start, start + len(batches)))  # none lost, none twice
        return batches
    raise AssertionError("the subscriber never received an event")

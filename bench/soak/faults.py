"""The seeded fault schedule: which fault, when, on what, for how long. The schedule is a pure
function of (seed, run length), so a failing run is replayed with the same `--seed` and length."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

KINDS = (
    "server_kill9",
    "server_stop",
    "client_stop",
    "client_stop_mid_write",
    "redis_kill",
    "fs_full",
    "client_kill_mid_write",
)
WARMUP_S = 12.0


@dataclass(frozen=True)
class Fault:
    at: float  # seconds after the start of the load
    kind: str
    hold: float  # seconds the fault lasts (a stop, a down time, a full filesystem)
    target: int  # which client, for client faults (an index into the clients)

    def describe(self) -> str:
        return f"t={self.at:.1f}s {self.kind} hold={self.hold:.1f}s target={self.target}"

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def schedule(seed: int, duration: float, lease_ttl: float, clients: int) -> list[Fault]:
    """Every kind once per round, in a shuffled order, with gaps between faults so recovery shows."""
    rng = random.Random(seed)
    faults: list[Fault] = []
    t = WARMUP_S
    while True:
        kinds = list(KINDS)
        rng.shuffle(kinds)
        for kind in kinds:
            hold = {
                "server_kill9": rng.uniform(0.5, 3.0),
                "server_stop": lease_ttl * rng.uniform(1.5, 2.5),
                "client_stop": lease_ttl * rng.uniform(1.5, 3.0),
                "client_stop_mid_write": lease_ttl * rng.uniform(2.5, 4.0),  # past the TTL and the quarantine
                "redis_kill": rng.uniform(1.0, 4.0),
                "fs_full": rng.uniform(2.0, 6.0),
                "client_kill_mid_write": rng.uniform(0.5, 2.0),
            }[kind]
            if t + hold + 8.0 > duration:
                return faults
            faults.append(Fault(round(t, 2), kind, round(hold, 2), rng.randrange(clients)))
            t += hold + rng.uniform(4.0, 9.0)

"""The soak's conductor: starts Redis, the small fs, the kvserver and the clients, plays the fault
schedule, samples the server, checks durable objects around every fault, and returns the report."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import redis

from bench.soak import report as rep
from bench.soak.faults import Fault, schedule
from bench.soak.hostile import Hostile
from bench.soak.stack import Redis, Server, SmallFs
from bench.soak.worker import Spec

LEASE_TTL = 2.0
REPO = Path(__file__).resolve().parents[2]  # workers run `-m bench.soak.worker` from here
READY_TIMEOUT_S = 180.0
FS_MIB = 96


@dataclass(frozen=True)
class ClientRole:
    name: str
    tenant: str
    tag: str
    world: int
    mode: str
    slow: bool = False


ROLES = (
    ClientRole("a-shm-vllm", "tenant-a", "vllm_cpu", 1, "shm"),
    ClientRole("a-tcp-vllm", "tenant-a", "vllm_cpu", 1, "tcp"),
    ClientRole("b-tcp-flash", "tenant-b", "flash_attn", 1, "tcp"),
    ClientRole("b-tp2-shm-vllm", "tenant-b", "vllm_cpu", 2, "shm"),
    ClientRole("a-slow-shm-flash", "tenant-a", "flash_attn", 1, "shm", slow=True),
)


def progress(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Clients:
    """The client processes: spawned, stopped, killed and respawned; each incarnation logs its ops
    to its own JSON-lines file."""

    def __init__(self, workdir: Path, server: Server, seed: int, deadline: float) -> None:
        self.dir, self.server, self.seed, self.deadline = workdir / "events", server, seed, deadline
        self.dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.incarnations = [0] * len(ROLES)
        self.expected_deaths: set[int] = set()  # pids the soak killed on purpose
        self.crashes: list[str] = []

    def spawn(self, i: int) -> None:
        role = ROLES[i]
        self.incarnations[i] += 1
        n = self.incarnations[i]
        spec = Spec(
            name=role.name,
            url=self.server.url,
            token=self.server.tokens[role.tenant],
            tenant=role.tenant,
            tag=role.tag,
            world=role.world,
            mode=role.mode,
            slow=role.slow,
            seed=self.seed * 1000 + i * 10 + n,
            deadline=self.deadline,
            events=str(self.dir / f"{role.name}-{n}.jsonl"),
            lease_ttl=LEASE_TTL,
        )
        log = open(self.dir / f"{role.name}-{n}.log", "ab")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "bench.soak.worker", json.dumps(asdict(spec))]
        self.procs[i] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)

    def wait_ready(self, timeout: float) -> None:
        """Wait until every first incarnation registered (torch imports take a while on 2 cores), so
        the schedule's clock measures load, not start-up; the clients then run to `self.deadline`,
        which they read from a file (they were spawned before it was known)."""
        deadline = time.time() + timeout
        while len(list(self.dir.glob("*.ready"))) < len(ROLES):
            if time.time() > deadline:
                raise RuntimeError(f"clients not ready within {timeout:.0f}s; logs in {self.dir}")
            time.sleep(0.2)

    def check(self) -> None:
        """Respawn a client that died on its own (counted as a crash) while the run goes on."""
        for i, proc in list(self.procs.items()):
            if proc.poll() is not None and proc.returncode != 0 and proc.pid not in self.expected_deaths:
                self.crashes.append(f"{ROLES[i].name}#{self.incarnations[i]} exit {proc.returncode}")
                if time.time() < self.deadline - 5:
                    self.spawn(i)

    def signal(self, i: int, sig: int) -> None:
        try:
            os.kill(self.procs[i].pid, sig)
        except ProcessLookupError:
            pass

    def armable(self, i: int, timeout: float = 60.0) -> bool:
        """Wait until client i's current incarnation handles the fault signals (it says "ready" only
        then): SIGUSR1/2 sent to one still importing torch would kill it by their default action."""
        ready = self.dir / f"{ROLES[i].name}-{self.incarnations[i]}.jsonl.ready"
        deadline = time.time() + timeout
        while not ready.exists():
            if time.time() > deadline or self.procs[i].poll() is not None:
                return False
            time.sleep(0.1)
        return True

    def events(self) -> list[dict[str, Any]]:
        out = []
        for path in sorted(self.dir.glob("*.jsonl")):
            for line in path.read_text().splitlines():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass  # a line cut by a kill -9
        return out

    def finish(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class Durability:
    """What the persisting tiers held before each fault must still be there after it. The tiers are
    read directly (the fs tier's object files, renamed into place after an fsync; Redis keys, with
    appendfsync always), so 'durable' means the tier confirmed the write."""

    def __init__(self, fs: SmallFs, red: Redis) -> None:
        self.fs, self.red = fs, red
        self.known: set[str] = set()
        self.lost: set[str] = set()
        self.redis_unreadable = 0

    def current(self) -> set[str]:
        found = {f"fs:{p}" for p in self.fs.objects()}
        try:
            found |= {f"redis:{k}" for k in self.red.object_keys()}
        except redis.RedisError:
            self.redis_unreadable += 1
            found |= {k for k in self.known if k.startswith("redis:")}  # unknown now: checked next time
        return found

    def checkpoint(self) -> int:
        now = self.current()
        missing = self.known - now
        self.lost |= missing
        self.known = now
        return len(missing)


def run(seed: int, seconds: float, workdir: Path) -> dict[str, Any]:
    faults = schedule(seed, seconds, LEASE_TTL, len(ROLES))
    progress(f"seed {seed}, {seconds:.0f} s, {len(faults)} faults, workdir {workdir}")
    red = Redis(workdir)
    red.start()
    fs = SmallFs(workdir, FS_MIB)
    server = Server(workdir, [f"fs://{fs.root}?fsync=1", red.url], LEASE_TTL)
    server.start()
    durable = Durability(fs, red)
    server_up = threading.Event()
    server_up.set()
    hostile = Hostile(server.url, server.tokens["tenant-a"], seed, server_up.is_set)
    samples: list[dict[str, Any]] = []
    clients = Clients(workdir, server, seed, time.time() + seconds + READY_TIMEOUT_S)
    records: list[dict[str, Any]] = []
    stop = threading.Event()
    counters: dict[int, dict[str, Any]] = {}
    sampler = threading.Thread(target=_sample, args=(server, samples, counters, stop), daemon=True)
    try:
        for i in range(len(ROLES)):
            clients.spawn(i)
        clients.wait_ready(READY_TIMEOUT_S)
        start = time.time()
        clients.deadline = start + seconds
        progress("clients ready; load and faults start")
        hostile.start()
        sampler.start()
        last_progress = time.time()
        for fault in faults:
            while time.time() < start + fault.at:
                time.sleep(0.2)
                clients.check()
                if time.time() - last_progress > 10:
                    last_progress = time.time()
                    progress(f"t={time.time() - start:.0f}s ops {len(clients.events())} lost {len(durable.lost)}")
            lost_before = durable.checkpoint()
            progress(f"fault {fault.describe()} (durable objects {len(durable.known)}, lost so far {lost_before})")
            records.append(_inject(fault, server, red, fs, clients, server_up))
        while time.time() < start + seconds:
            time.sleep(0.5)
            clients.check()
        clients.finish()
        durable.checkpoint()
    finally:
        stop.set()
        hostile.stopping.set()
        for proc in clients.procs.values():
            if proc.poll() is None:
                proc.kill()
        server.stop()
        red.kill()
        fs.close()
    events = clients.events()
    windows = [(r["start"], r["end"]) for r in records if not r.get("skipped")]
    return {
        "seed": seed,
        "seconds": seconds,
        "faults": records,
        "fault_schedule": [f.describe() for f in faults],
        "ops": rep.ops_table(events),
        "wrong_blocks": sum(e.get("wrong", 0) for e in events),
        "durable": {
            "checked": len(durable.known | durable.lost),
            "lost": len(durable.lost),
            "lost_examples": sorted(durable.lost)[:10],
            "fs_mounted": fs.mounted,
            "redis_unreadable_checkpoints": durable.redis_unreadable,
        },
        "recovery": rep.recovery(events, records),
        "latency": rep.latency(events, windows),
        "server": rep.resources(samples, warmup_s=15.0),
        "apart_from_losses": rep.server_counters(counters),
        "hostile": hostile.summary(),
        "client_crashes": clients.crashes,
    }


def _inject(
    fault: Fault, server: Server, red: Redis, fs: SmallFs, clients: Clients, server_up: threading.Event
) -> dict[str, Any]:
    """Apply one fault, hold it, undo it; returns its record with wall-clock start and end."""
    rec: dict[str, Any] = {"kind": fault.kind, "at": fault.at, "hold": fault.hold, "start": time.time()}
    if fault.kind == "server_kill9":
        server_up.clear()
        server.kill()
        time.sleep(fault.hold)
        server.start()
        server_up.set()
    elif fault.kind == "server_stop":
        server_up.clear()
        server.signal(signal.SIGSTOP)
        time.sleep(fault.hold)
        server.signal(signal.SIGCONT)
        server_up.set()
    elif fault.kind == "client_stop":
        rec["client"] = ROLES[fault.target].name
        clients.signal(fault.target, signal.SIGSTOP)
        time.sleep(fault.hold)
        clients.signal(fault.target, signal.SIGCONT)
    elif fault.kind == "client_stop_mid_write":  # stopped inside a save: its reservation outlives the TTL
        rec["client"] = ROLES[fault.target].name
        if not clients.armable(fault.target):
            rec["skipped"] = "the client was not ready for the fault signal"
            rec["end"] = time.time()
            return rec
        clients.signal(fault.target, signal.SIGUSR2)
        rec["stopped_in_save"] = _wait_stopped(clients.procs[fault.target].pid, 5.0)
        if not rec["stopped_in_save"]:
            clients.signal(fault.target, signal.SIGSTOP)
        time.sleep(fault.hold)
        clients.signal(fault.target, signal.SIGCONT)
    elif fault.kind == "redis_kill":
        red.kill()
        time.sleep(fault.hold)
        red.start()
    elif fault.kind == "fs_full":
        if not fs.mounted:
            rec["skipped"] = "no small filesystem (mount needs root)"
        else:
            rec["filler_bytes"] = fs.fill()
            time.sleep(fault.hold)
            fs.unfill()
    elif fault.kind == "client_kill_mid_write":
        i = fault.target
        rec["client"] = ROLES[i].name
        if not clients.armable(i):
            rec["skipped"] = "the client was not ready for the fault signal"
            rec["end"] = time.time()
            return rec
        proc = clients.procs[i]
        clients.expected_deaths.add(proc.pid)
        clients.signal(i, signal.SIGUSR1)
        try:
            proc.wait(timeout=15)
            rec["died_in_save"] = proc.returncode == -signal.SIGKILL
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rec["died_in_save"] = False
        time.sleep(fault.hold)
        clients.spawn(i)
    rec["end"] = time.time()
    return rec


def _wait_stopped(pid: int, timeout: float) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T":
                return True
        except OSError:
            return False
        time.sleep(0.005)
    return False


def _sample(
    server: Server, samples: list[dict[str, Any]], counters: dict[int, dict[str, Any]], stop: threading.Event
) -> None:
    """Server RSS (and its anonymous part: the arena's shared pages are not the server's growth) and
    open descriptors, once a second, from /proc; and the server's own counters (evictions, L2 drops)
    from `describe`, the last answer per server process."""
    while not stop.wait(1.0):
        pid = server.pid
        if pid is None:
            continue
        try:
            with server.proc.client(timeout=0.5) as c:  # type: ignore[union-attr]
                counters[pid] = c.call("describe").result
        except Exception:
            pass  # down or stopped: the previous answer stands
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            fds = len(os.listdir(f"/proc/{pid}/fd"))
            if fields.get("State", "").strip().startswith("T"):
                continue  # stopped by a fault
            samples.append(
                {
                    "t": time.time(),
                    "pid": pid,
                    "rss_kb": int(fields["VmRSS"].split()[0]),
                    "anon_kb": int(fields["RssAnon"].split()[0]),
                    "fds": fds,
                }
            )
        except (OSError, KeyError, ValueError):
            continue

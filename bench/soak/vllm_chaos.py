"""`python -m bench.soak.vllm_chaos [--minutes 5] [--seed S] [--json PATH]`: two real vLLM engines hold
multi-turn chats through one kvserver while the server is killed (-9) and restarted warm, stopped
past the connector's timeout, and its Redis L2 goes away; every output must equal a no-connector
baseline of the same conversations, token for token (#40 item 4; outside CI: minutes of two engines).

The workload: conversation sets of `users` chats of `turns` turns over one shared system prompt (two
chunks), each later turn the previous prompt, its answer and a new user message, one batch per turn.
Engine A runs the sets in order, engine B in reverse, so each loads what the other stored (cross
engine reuse) and reloads its own earlier turns (vLLM's prefix cache is off, so every reuse goes
through the server). The baseline is one engine without the connector over the same sets.
Faults come from a seeded schedule while both engines run; each engine stays up through all of them.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.soak.stack import Redis, Server
from kvtestkit.engines.tiny_model import random_prompt
from kvtestkit.engines.vllm_harness import EngineRun, build_model, next_turn, prompt, run_engine

CHUNK, BLOCK, MAX_TOKENS = 64, 32, 8
SYSTEM = random_prompt(2 * CHUNK, seed=401)  # the shared prefix: two chunks
FAULT_KINDS = ("server_kill9", "server_stop", "redis_kill")


def conversation_batches(sets: list[int], users: int, turns: int) -> list[list[dict[str, Any]]]:
    """One batch per (set, turn); a later turn extends the same user's request of the previous batch."""
    batches: list[list[dict[str, Any]]] = []
    for s in sets:
        first = len(batches)
        for t in range(turns):
            batch = []
            for u in range(users):
                msg = random_prompt(40 + (u * 13 + t * 7) % 50, seed=10_000 * s + 100 * u + t)
                if t == 0:
                    batch.append(prompt(SYSTEM + msg))
                else:
                    batch.append(next_turn(first + t - 1, u, msg))
            batches.append(batch)
    return batches


def outputs_by_key(run: EngineRun, sets: list[int], users: int, turns: int) -> dict[tuple[int, int, int], list[int]]:
    """(set, turn, user) -> generated token ids."""
    out: dict[tuple[int, int, int], list[int]] = {}
    for i, batch in enumerate(run.batches):
        s, t = sets[i // turns], i % turns
        for u, r in enumerate(batch.requests):
            out[(s, t, u)] = r.token_ids
    return out


def fault_schedule(seed: int, seconds: float) -> list[tuple[float, str, float]]:
    """(at, kind, hold): every kind once per round, shuffled, 12-25 s apart, after a warm-up."""
    rng = random.Random(seed)
    out, t = [], 25.0
    while t < seconds - 20:
        kinds = list(FAULT_KINDS)
        rng.shuffle(kinds)
        for kind in kinds:
            hold = {"server_kill9": rng.uniform(0.5, 3.0), "server_stop": rng.uniform(3.0, 6.0)}.get(
                kind, rng.uniform(2.0, 6.0)
            )
            out.append((round(t, 1), kind, round(hold, 1)))
            t += hold + rng.uniform(12.0, 25.0)
    return [f for f in out if f[0] < seconds - 20]


class Faults(threading.Thread):
    """Applies the schedule against the server and Redis until `stop` is set or the schedule ends."""

    def __init__(self, server: Server, red: Redis, schedule: list[tuple[float, str, float]]) -> None:
        super().__init__(daemon=True)
        self.server, self.red, self.schedule = server, red, schedule
        self.stop = threading.Event()
        self.applied: list[dict[str, Any]] = []
        self.t0 = time.monotonic()

    def run(self) -> None:
        for at, kind, hold in self.schedule:
            if self.stop.wait(max(0.0, self.t0 + at - time.monotonic())):
                return
            print(f"[vllm-chaos] t={time.monotonic() - self.t0:.0f}s {kind} hold={hold}s", flush=True)
            if kind == "server_kill9":
                self.server.kill()
                time.sleep(hold)
                self.server.start()  # same port: adopts the arena the kill left (warm restart)
            elif kind == "server_stop":
                self.server.signal(signal.SIGSTOP)
                time.sleep(hold)
                self.server.signal(signal.SIGCONT)
            else:
                self.red.kill()
                time.sleep(hold)
                self.red.start()
            self.applied.append({"at": round(time.monotonic() - self.t0, 1), "kind": kind, "hold": hold})


def run(seed: int, minutes: float, workdir: Path, users: int, turns: int, sets_n: int | None) -> dict[str, Any]:
    model = build_model(workdir / "model")
    red = Redis(workdir)
    red.start()
    server = Server(workdir, [red.url], lease_ttl=5.0, l1_gb=0.004)  # small: older chunks live only in Redis
    server.start()
    seconds = minutes * 60
    # a set of 4 users x 5 turns took ~2 s of each engine here (tiny model, 2 busy cores, both
    # engines beside each other): sized so that the engines run about `minutes` after their start
    n = sets_n or max(2, int(seconds / 2.5))
    sets = list(range(n))
    a_sets, b_sets = sets, sets[::-1]
    token = server.tokens["tenant-a"]
    extra = {"kvserver_url": server.url, "chunk_size": CHUNK, "api_token": token, "timeout_s": 2.0}
    kv = {
        "kv_connector": "KVServerConnector",
        "kv_connector_module_path": "kvconnector.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {**extra, "save_policy": "all", "plan_loads": False, "retry_after_s": 0.5},
    }
    common: dict[str, Any] = dict(
        max_tokens=MAX_TOKENS, block_size=BLOCK, llm_kwargs={"enable_prefix_caching": False}, timeout=seconds * 4
    )
    runs: dict[str, EngineRun] = {}
    errors: dict[str, str] = {}

    def engine(name: str, order: list[int]) -> None:
        try:
            runs[name] = run_engine(
                model,
                conversation_batches(order, users, turns),
                kv_transfer_config=kv,
                **common,
                workdir=workdir / name,
            )
        except Exception as exc:  # reported, and the run fails
            errors[name] = f"{type(exc).__name__}: {exc}"[-3000:]

    faults = Faults(server, red, fault_schedule(seed, seconds))
    t0 = time.monotonic()
    threads = [threading.Thread(target=engine, args=(n_, o)) for n_, o in (("a", a_sets), ("b", b_sets))]
    for th in threads:
        th.start()
    faults.start()
    for th in threads:
        th.join()
    faults.stop.set()
    faults.join()
    chaos_s = time.monotonic() - t0
    server.stop()
    red.kill()
    print("[vllm-chaos] baseline (no connector)", flush=True)
    base = run_engine(model, conversation_batches(sets, users, turns), **common, workdir=workdir / "baseline")
    want = outputs_by_key(base, sets, users, turns)
    report: dict[str, Any] = {
        "seed": seed,
        "users": users,
        "turns": turns,
        "sets": n,
        "chaos_s": round(chaos_s, 1),
        "faults": faults.applied,
        "errors": errors,
    }
    for name, order in (("a", a_sets), ("b", b_sets)):
        if name not in runs:
            continue
        got = outputs_by_key(runs[name], order, users, turns)
        wrong = sorted(k for k in got if got[k] != want[k])
        reqs = runs[name].requests
        report[name] = {
            "requests": len(reqs),
            "identical": len(reqs) - len(wrong),
            "different": [list(k) for k in wrong[:20]],
            "loaded_tokens": sum(r.connector_loaded_tokens for r in reqs),
            "prompt_tokens": sum(r.prompt_len for r in reqs),
            "requests_with_a_load": sum(1 for r in reqs if r.connector_loaded_tokens),
        }
    report["pass"] = not errors and all(report[x]["different"] == [] for x in ("a", "b") if x in report)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.soak.vllm_chaos", description=__doc__)
    ap.add_argument("--minutes", type=float, default=5.0, help="about how long the two engines run")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--sets", type=int, default=None, help="conversation sets per engine (default: from --minutes)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(1 << 24)
    with tempfile.TemporaryDirectory(prefix="kv-vllm-chaos-") as tmp:
        report = run(seed, args.minutes, Path(tmp), args.users, args.turns, args.sets)
    for name in ("a", "b"):
        if name in report:
            r = report[name]
            print(
                f"engine {name}: {r['identical']}/{r['requests']} outputs identical to the baseline, "
                f"{r['requests_with_a_load']} requests loaded {r['loaded_tokens']} "
                f"of {r['prompt_tokens']} prompt tokens"
            )
    print(f"faults: {len(report['faults'])} ({', '.join(f['kind'] for f in report['faults'])}); seed {seed}")
    if report["errors"]:
        print(f"engine errors: {report['errors']}", file=sys.stderr)
    print("PASS" if report["pass"] else f"FAIL: replay with --seed {seed} --minutes {args.minutes:g}")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())

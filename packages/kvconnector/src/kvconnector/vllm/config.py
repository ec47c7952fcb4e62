"""`kv_connector_extra_config` of KVServerConnector: parsed and checked once, at connector start.

Why its own module: a typo in a deployment's JSON must fail loudly when the engine starts, not
silently disable caching, and the parsing needs neither vLLM nor torch (unit-testable anywhere).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvprotocol import DEFAULT_CHUNK_SIZE, DEFAULT_URL

MODES = ("auto", "shm", "tcp")
COPY_BACKENDS = ("auto", "host", "torch")  # engine_client.COPY_BACKENDS (not imported: no torch here)
SAVE_POLICIES = ("prompt", "all", "none")


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """Options (keys of `kv_connector_extra_config`).

    kvserver_url     ZMQ endpoint of the kvserver (default: $KVSERVER_URL, else tcp://127.0.0.1:5555)
    mode             data plane: "auto" (shm when the server's arena is mappable, else tcp), "shm", "tcp"
    timeout_s        per-operation timeout towards the server; on a timeout the engine recomputes
    save_policy      "all" (default): store full chunks of prompts and of the tokens generated after
                     them, as vLLM's own prefix cache keeps them (a chat's or an agent's next prompt
                     holds the answer); "prompt": prompts only (e.g. a reasoning model whose template
                     drops earlier turns' thinking, so answers never come back); "none": read only.
                     Under reservations (a kv_producer's default) "all" stores prompts only
    chunk_size       tokens per cached object; a multiple of vLLM's block size, equal to the server's
                     (with recurrent-state layers, e.g. GDN: exactly vLLM's hybrid block size)
    model_name       names the model in cache keys (default: vLLM's served model name or model path);
                     the key's model part is `<model_name>@<fingerprint>` (see fingerprint.py)
    model_id         an operator-chosen identity of the weights that replaces the model path and the
                     weight-file digest in the fingerprint: engines that load the same weights from
                     different paths share with it; never give two different weights one model_id
    api_token        the credential towards the server, e.g. a tenant's token (`kvserver tenant add`):
                     the tenant's key namespace, quota and caps apply; default: $KVSERVER_API_TOKEN,
                     else $KVSERVER_API_TOKEN_FILE, else the server's default token file
    token_file       read that credential from this file instead (a mounted secret)
    retry_after_s    after a failed server call, skip the server this long (doubling up to 30 s) so a
                     dead server costs one timeout, not one per request
    lookup_wait_s    how long vLLM's scheduler waits at least for a lookup's answer (default 0.002): a
                     later answer is collected when vLLM asks again at its next step ("ask again
                     later", None), which delays that request by a step
    lookup_wait_step_share  and up to this share of a recent busy step (default 0.1; 0: lookup_wait_s
                     only): a wait halts the engine's running requests for its length, "ask again
                     later" costs the new request a whole step (lookup_wait.py)
    lookup_wait_max_s  the longest such wait (default 0.02)
    lookup_wait_idle_s  how long to wait when no request of the engine is running (default 0.1): the
                     wait then halts nobody, and "ask again later" would only spin empty steps
    lookup_miss_reuse_s  a request vLLM could not schedule after a lookup that found nothing is asked
                     about again within this many seconds (default 0.5): the miss is reused instead of
                     a new round trip (and perhaps another step of "ask again later"); 0: always ask
    lookup_hit_reuse_s  the same for a lookup that hit (default 0.5, at most 5): a call asking the same
                     (same length, same local prefix) gets the same answer under the leases its lookup
                     took, which stay held meanwhile; 0: always ask
    wait_for_l2      False (default): a lookup never waits for the server's L2 prefetch; while one runs
                     the connector tells vLLM "ask again later" (None) and reports the hit once it is
                     in L1. True: the lookup blocks up to the server's --l2-prefetch-timeout
    stream_l2        True (default; with async_loads and wait_for_l2 false): a lookup that starts an L2
                     prefetch waits on the server only for the prefetch to locate its objects, then
                     reports the whole hit L1 + L2 will cover; the worker's background load copies each
                     chunk as it lands in L1 (each verified) and reports a chunk that never lands as a
                     failed load, which vLLM recomputes (docs/l2.md). Such loads run on a thread
                     and server connection of their own (a third EngineClient per worker, its arena
                     mapping not populated), so the L1 hits after them never wait for a prefetch.
                     False: "ask again later" until the whole prefetch has landed, then load
    async_loads      True (default): loads run on a background thread (vLLM's asynchronous path: the
                     request waits in WAITING_FOR_REMOTE_KVS, other requests keep decoding, completion is
                     reported through get_finished); False: loads run inside the step, before the forward
    in_step_load_share  with async_loads, a hit whose load is estimated (costs.py) to take at most this
                     share of the engine's recent step (default 1: one step) is loaded inside the step
                     instead: a background load parks the request for at least a step, holding its
                     blocks while it computes nothing, which costs more than a copy of a few
                     milliseconds (on a CPU engine the copy shares the cores with the forward anyway). Larger
                     loads, streamed L2 hits and models with several KV cache groups load in the
                     background. 0: every load in the background; above 1: in the step even when
                     the copy outlasts a step (at most 100)
    async_saves      True (default): saves return at once and run on the background thread; vLLM keeps
                     a finished request's blocks until its saves ended ("finished sending"); a
                     preemption waits for the saves in flight. False: saves run in wait_for_save
    tails            True (default): with async_saves, a finished request's tokens past its last full
                     chunk are saved as well, as a tail object (its prompt's, and with save_policy
                     "all" one reaching the end of its answer), and lookups find such tails, so the
                     next turn of a conversation loads up to there instead of recomputing up to a chunk more
                     (docs/vllm.md). Only where the server takes tails and every KV cache group is plain
                     full attention, for requests without extra keys (adapters, images). False: whole
                     chunks only
    plan_loads       True (default): load a hit only when the estimate (costs.py: load throughput seeded
                     by a calibration at start, then both rates measured by the workers) says it is
                     cheaper than recomputing it; declined hits are counted (declined_hits,
                     declined_tokens). False: always load
    reserve          True: a producer's prompt saves book the whole request on the server at its first
                     store (whole-request reservation, docs/pd.md); a save told RETRY_LATER is retried
                     for up to reserve_wait_s. Default: on for kv_role "kv_producer" (see apply_role)
    copy_backend     "auto" (default): KV on a GPU is copied by the CUDA copier (torch ops on a side
                     stream, _torch_copy.py), KV in host memory by the C++ kernel; "torch": the CUDA
                     copier's code on any device (it runs on CPU KV too: how its indexing is tested
                     with a real engine); "host": the C++ kernel (CPU KV only)
    populate_arena   True (default): right after mapping the server's shm arena, fill the mapping's page
                     tables on a background thread (the pages the server already allocated, e.g. with
                     --prefault), so the first save or load through each page does not page-fault (a
                     first write ran at 17-22% of a warm copy's speed here, bench/populate.py);
                     costs about 0.1 s of that thread and 2 MiB of page tables per GiB of arena.
                     False: pages are mapped at their first copy
    reserve_wait_s   how long a producer's save retries a reservation the server cannot admit yet
    inflight_wait_s  how long a lookup that finds its prefix still being written by a producer, or
                     announced by another engine (reply `inflight`), asks vLLM to ask again later
                     before it recomputes instead
    announce_max_s   a step that computes chunks it will save first announces them to the server
                     (before its forward), so another engine's lookup of the same prefix waits for
                     them instead of computing them too; the announcement lasts the step's estimated
                     time and save, at most this many seconds (default 2; at most 5; 0: never announce)
    share_loads      True (default): a request whose next chunk another request of this engine is loading
                     asynchronously waits for that load (vLLM then finds the prefix in its own prefix
                     cache) instead of loading the same chunks again (local_loads.py); needs vLLM's
                     prefix caching, bounded by timeout_s. False: every request loads its own copy
    debug_load_delay_s  TEST ONLY: sleep this long before each load's copy (a slow load on purpose)
    debug_save_delay_s  TEST ONLY: sleep this long before each background save (async_saves)
    debug_hold_saves_for_load  TEST ONLY: end that sleep as soon as a background load ended (a test
                     that a load does not wait for earlier saves, without racing a clock)
    debug_fail_load_chunks  TEST ONLY fault injection: after each load, overwrite the blocks of these
                     chunk indexes with garbage and report them as failed, so tests can prove that
                     vLLM's kv_load_failure_policy recomputes them
    debug_fail_plan_loads  TEST ONLY: plan every load as if the request's blocks could not be named
                     (the scheduler's fail-safe branch): the blocks are reported failed, never loaded
    """

    kvserver_url: str = DEFAULT_URL
    mode: str = "auto"
    timeout_s: float = 5.0
    save_policy: str = "all"
    chunk_size: int = DEFAULT_CHUNK_SIZE
    model_name: str | None = None
    model_id: str | None = None
    retry_after_s: float = 2.0
    api_token: str | None = dataclasses.field(default=None, repr=False)  # never in a log line
    token_file: str | None = None
    wait_for_l2: bool = False
    stream_l2: bool = True
    lookup_wait_s: float = 0.002
    lookup_wait_step_share: float = 0.1
    lookup_wait_max_s: float = 0.02
    lookup_wait_idle_s: float = 0.1
    lookup_miss_reuse_s: float = 0.5
    lookup_hit_reuse_s: float = 0.5
    async_loads: bool = True
    in_step_load_share: float = 1.0
    plan_loads: bool = True
    tails: bool = True
    async_saves: bool = True
    reserve: bool | None = None  # None: as the role says (apply_role)
    reserve_wait_s: float = 10.0
    populate_arena: bool = True
    copy_backend: str = "auto"
    inflight_wait_s: float = 10.0
    announce_max_s: float = 2.0
    share_loads: bool = True
    debug_load_delay_s: float = 0.0
    debug_save_delay_s: float = 0.0
    debug_hold_saves_for_load: bool = False
    debug_fail_load_chunks: tuple[int, ...] = ()
    debug_fail_plan_loads: bool = False  # TEST ONLY: take _plan's "cannot name the blocks" branch
    load: bool = True  # not a key: False for kv_role "kv_producer" (saves only); see apply_role

    def apply_role(self, is_producer: bool, is_consumer: bool) -> ConnectorConfig:
        """kv_producer saves only (its prompts under whole-request reservations unless reserve is
        false), kv_consumer loads only, kv_both does both.

        A reservation books a prompt's chunks, known when the request starts, so under one "all"
        stores the prompt only (a prefiller's answer is the decoder's to compute)."""
        reserve = (is_producer and not is_consumer) if self.reserve is None else self.reserve
        policy = self.save_policy if is_producer else "none"
        if reserve and policy == "all":
            policy = "prompt"
        return dataclasses.replace(self, load=is_consumer, reserve=reserve, save_policy=policy)

    def streams_l2(self) -> bool:
        """Whether L2 hits are streamed: reported before they land and loaded as they do."""
        return self.stream_l2 and self.async_loads and self.load and not self.wait_for_l2

    def token(self) -> str | None:
        """The configured credential (api_token, or token_file's content); None: the client's defaults."""
        if self.token_file is None:
            return self.api_token
        from pathlib import Path

        from kvprotocol._credentials import read_private

        return read_private(Path(self.token_file), strict=False)

    def check_block_size(self, block_size: int) -> None:
        if block_size <= 0 or self.chunk_size % block_size:
            raise ValueError(
                f"KVServerConnector: chunk_size {self.chunk_size} must be a multiple of vLLM's block size "
                f"{block_size} (set kv_connector_extra_config.chunk_size or --block-size)"
            )


_TYPES: dict[str, tuple[type, ...]] = {
    "kvserver_url": (str,),
    "mode": (str,),
    "timeout_s": (int, float),
    "save_policy": (str,),
    "chunk_size": (int,),
    "model_name": (str, type(None)),
    "model_id": (str, type(None)),
    "retry_after_s": (int, float),
    "api_token": (str, type(None)),
    "token_file": (str, type(None)),
    "debug_fail_load_chunks": (list, tuple),
    "debug_fail_plan_loads": (bool,),
    "wait_for_l2": (bool,),
    "stream_l2": (bool,),
    "async_loads": (bool,),
    "in_step_load_share": (int, float),
    "plan_loads": (bool,),
    "tails": (bool,),
    "async_saves": (bool,),
    "share_loads": (bool,),
    "debug_load_delay_s": (int, float),
    "debug_save_delay_s": (int, float),
    "debug_hold_saves_for_load": (bool,),
    "reserve": (bool, type(None)),
    "reserve_wait_s": (int, float),
    "inflight_wait_s": (int, float),
    "announce_max_s": (int, float),
    "lookup_wait_s": (int, float),
    "lookup_wait_step_share": (int, float),
    "lookup_wait_max_s": (int, float),
    "lookup_wait_idle_s": (int, float),
    "lookup_miss_reuse_s": (int, float),
    "lookup_hit_reuse_s": (int, float),
    "populate_arena": (bool,),
    "copy_backend": (str,),
}


URL_ENV = "KVSERVER_URL"  # how a container learns its node's server (e.g. tcp://$(HOST_IP):5555)


def parse_config(extra: Mapping[str, object] | None, environ: Mapping[str, str] | None = None) -> ConnectorConfig:
    """Build a ConnectorConfig from kv_connector_extra_config; unknown keys and bad values raise ValueError.

    kvserver_url: the key if set, else $KVSERVER_URL, else the loopback default.
    """
    fields: dict[str, Any] = dict(extra or {})  # each value checked against _TYPES below
    env_url = (os.environ if environ is None else environ).get(URL_ENV)
    if "kvserver_url" not in fields and env_url:
        fields["kvserver_url"] = env_url
    unknown = sorted(set(fields) - set(_TYPES))
    if unknown:
        raise ValueError(
            f"KVServerConnector: unknown kv_connector_extra_config keys {unknown}; known: {sorted(_TYPES)}"
        )
    for key, value in fields.items():
        ok = isinstance(value, _TYPES[key]) and (not isinstance(value, bool) or bool in _TYPES[key])
        if not ok:
            raise ValueError(f"KVServerConnector: {key} has type {type(value).__name__}")
    cfg = ConnectorConfig(
        **{k: v for k, v in fields.items() if k != "debug_fail_load_chunks"},
        debug_fail_load_chunks=tuple(fields.get("debug_fail_load_chunks", ())),
    )
    if not cfg.kvserver_url.startswith(("tcp://", "ipc://")):
        raise ValueError(f"KVServerConnector: kvserver_url must be tcp:// or ipc://, got {cfg.kvserver_url!r}")
    if cfg.mode not in MODES:
        raise ValueError(f"KVServerConnector: mode must be one of {MODES}, got {cfg.mode!r}")
    if cfg.copy_backend not in COPY_BACKENDS:
        raise ValueError(f"KVServerConnector: copy_backend must be one of {COPY_BACKENDS}, got {cfg.copy_backend!r}")
    if cfg.save_policy not in SAVE_POLICIES:
        raise ValueError(f"KVServerConnector: save_policy must be one of {SAVE_POLICIES}, got {cfg.save_policy!r}")
    if not (0 <= cfg.reserve_wait_s <= 600 and 0 <= cfg.inflight_wait_s <= 600):
        raise ValueError("KVServerConnector: reserve_wait_s and inflight_wait_s must be in [0, 600]")
    if not 0 <= cfg.announce_max_s <= 5:
        raise ValueError("KVServerConnector: announce_max_s must be in [0, 5]")
    if not all(0 <= w <= 1 for w in (cfg.lookup_wait_s, cfg.lookup_wait_max_s, cfg.lookup_wait_idle_s)):
        raise ValueError("KVServerConnector: lookup_wait_s, lookup_wait_max_s and lookup_wait_idle_s must be in [0, 1]")
    if not 0 <= cfg.lookup_wait_step_share <= 1:
        raise ValueError("KVServerConnector: lookup_wait_step_share must be in [0, 1]")
    if not 0 <= cfg.in_step_load_share <= 100:
        raise ValueError("KVServerConnector: in_step_load_share must be in [0, 100]")
    if not 0 <= cfg.lookup_miss_reuse_s <= 60:
        raise ValueError("KVServerConnector: lookup_miss_reuse_s must be in [0, 60]")
    if not 0 <= cfg.lookup_hit_reuse_s <= 5:  # its leases are held meanwhile: well inside a lease's TTL
        raise ValueError("KVServerConnector: lookup_hit_reuse_s must be in [0, 5]")
    if not 0 < cfg.timeout_s <= 600:
        raise ValueError("KVServerConnector: timeout_s must be in (0, 600]")
    if not 0 <= cfg.retry_after_s <= 600:
        raise ValueError("KVServerConnector: retry_after_s must be in [0, 600]")
    if cfg.model_id is not None and not 1 <= len(cfg.model_id) <= 200:
        raise ValueError("KVServerConnector: model_id must be 1-200 characters")
    if not 1 <= cfg.chunk_size <= 65536:
        raise ValueError("KVServerConnector: chunk_size must be in [1, 65536]")
    if cfg.api_token is not None and cfg.token_file is not None:
        raise ValueError("KVServerConnector: set api_token or token_file, not both")
    if cfg.api_token is not None and (not cfg.api_token or any(ch.isspace() for ch in cfg.api_token)):
        raise ValueError("KVServerConnector: api_token must be non-empty without whitespace")
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in cfg.debug_fail_load_chunks):
        raise ValueError("KVServerConnector: debug_fail_load_chunks must be non-negative ints")
    return cfg

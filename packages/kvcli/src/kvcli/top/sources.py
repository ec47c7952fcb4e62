"""Where `kvcli top` gets its snapshots: servers polled directly, a coordinator, or a recording.

All sources return one Snapshot per instance per poll and never raise for an instance that is
down: a dashboard must keep running and show it as down.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from .._source import AuthRejected, Unreachable, check_url, fail_fast, http_json, is_http, zmq_call
from .model import Snapshot


class Source(Protocol):
    label: str

    def poll(self) -> list[Snapshot]: ...

    def close(self) -> None: ...


def instance_id(url: str) -> str:
    """A short name for an instance: host:port of its url."""
    parsed = urlparse(url)
    return parsed.netloc or url


class DirectSource:
    """Poll each url itself: ZMQ describe (tcp://, ipc://) or HTTP /v1/status (http://)."""

    def __init__(self, urls: Sequence[str], timeout: float = 1.0) -> None:
        from kvprotocol import Client

        self.urls = [check_url(u) for u in urls]
        self.timeout = timeout
        self.label = ", ".join(self.urls)
        from .._auth import cli_token

        self._clients = {u: Client(u, timeout=timeout, token=cli_token()) for u in self.urls if not is_http(u)}
        self._down = set(self.urls)  # probe before the first describe too: fail fast, not after a timeout
        self._pool = ThreadPoolExecutor(max_workers=min(16, len(self.urls)), thread_name_prefix="kvcli-top")

    def _one(self, url: str) -> Snapshot:
        t = time.time()
        try:
            if is_http(url):
                status = http_json(url, "/v1/status", self.timeout)
            else:
                if url in self._down:  # cheap check first, so a dead instance does not cost a timeout per poll
                    fail_fast(url, self.timeout)
                status = zmq_call(self._clients[url], "describe", self.timeout)
            self._down.discard(url)
            return Snapshot(instance_id(url), url, t, status=status)
        except AuthRejected as exc:
            self._down.discard(url)  # it answers: no probe needed next time
            return Snapshot(instance_id(url), url, t, reason=str(exc), auth=True)
        except Unreachable as exc:
            self._down.add(url)
            return Snapshot(instance_id(url), url, t, reason=str(exc))

    def poll(self) -> list[Snapshot]:
        return list(self._pool.map(self._one, self.urls))

    def close(self) -> None:
        # wait for calls in flight (each bounded by the timeout): a ZMQ socket closed while another
        # thread still uses it aborts the whole process (libzmq asserts in its signaler)
        self._pool.shutdown(wait=True, cancel_futures=True)
        for client in self._clients.values():
            client.close()


class CoordinatorSource:
    """One GET of the coordinator's fleet status per poll (it fans out to every instance)."""

    def __init__(self, url: str, timeout: float = 3.0) -> None:
        self.url = check_url(url)
        if not is_http(self.url):
            raise Unreachable(f"the coordinator speaks HTTP: {url!r} is not an http(s):// url")
        self.timeout = timeout
        self.label = f"coordinator {self.url}"

    def poll(self) -> list[Snapshot]:
        t = time.time()
        try:
            body = http_json(self.url, "/v1/fleet/status", self.timeout)
        except Unreachable as exc:
            return [Snapshot("coordinator", self.url, t, reason=str(exc), auth=isinstance(exc, AuthRejected))]
        return parse_fleet_status(body, t)

    def close(self) -> None:
        pass


def parse_fleet_status(body: Any, t: float) -> list[Snapshot]:
    """Snapshots from the coordinator's answer: {"instances": [{id, zmq_url, http_url, status, error}]}.

    Rows are named by the ZMQ address, not the registration id, so a restarted server (new id,
    same address) stays on its row.
    """
    items = body.get("instances", []) if isinstance(body, dict) else body
    out = []
    for item in items if isinstance(items, list) else []:
        if not isinstance(item, dict):
            continue
        zmq_url = item.get("zmq_url")
        iid = instance_id(str(zmq_url)) if zmq_url else str(item.get("id", "?"))
        url = str(zmq_url or item.get("http_url") or "")
        status = item.get("status")
        if isinstance(status, dict):
            out.append(Snapshot(iid, url, t, status=status))
        else:
            error = str(item.get("error") or "unreachable")
            out.append(Snapshot(iid, url, t, reason=error, auth=error.startswith(("HTTP 401", "HTTP 403"))))
    return out


class ReplaySource:
    """Recorded polls played back one per call (the last one repeats): screenshots and docs."""

    def __init__(self, frames: list[list[Snapshot]], label: str = "recording") -> None:
        if not frames:
            raise ValueError("a recording needs at least one poll")
        self.frames = frames
        self.label = label
        self._next = 0

    @classmethod
    def from_file(cls, path: Path) -> ReplaySource:
        data = json.loads(path.read_text())
        frames = [[Snapshot(**s) for s in frame] for frame in data["frames"]]
        return cls(frames, label=data.get("label", path.name))

    def poll(self) -> list[Snapshot]:
        frame = self.frames[min(self._next, len(self.frames) - 1)]
        self._next += 1
        return frame

    def close(self) -> None:
        pass

"""#34 finding 2: the KV-events sockets on loopback are closed to another OS user and to tenants.

A real eavesdropper process (eavesdropper.py) runs as `nobody` against a real server: it subscribes
to the PUB socket and asks the replay socket for everything, anonymously, with a guessed PLAIN
password, and with a tenant's token. ZMQ monitors tell when each handshake has failed, so the test
waits for that condition instead of a quiet period. Meanwhile tenant alice stores a prompt and the
owner's authenticated subscriber receives its token ids; the eavesdropper receives nothing. The
control: with `--insecure` (no configured token) the same eavesdropper reads alice's prompt.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvtestkit.kvhelpers import register, store, tiny_layout, payload
from kvprotocol import Client, resolve_token
from kvserver.kvevents import PLAIN_USER
from kvtestkit.kvsub import Subscriber, replay
from kvevents_util import sync
from kvtestkit.ports import with_fresh_ports
from kvtestkit.serverproc import ServerProc, free_port

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
BIN = Path(sys.executable).parent
VICTIM = list(range(7_000, 7_000 + 512))  # alice's prompt: two chunks


def _need_root() -> None:
    if os.getuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run a process as another OS user")


class Eavesdropper:
    """eavesdropper.py as nobody; reads its JSON lines."""

    def __init__(self, pub: str, rep: str, *passwords: str) -> None:
        env = {"PATH": os.environ.get("PATH", ""), "HOME": "/nonexistent"}
        cmd = [*NOBODY, sys.executable, str(Path(__file__).with_name("eavesdropper.py")), pub, rep, *passwords]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd="/"
        )
        self.got: list[dict[str, Any]] = []

    def until(self, key: str) -> Any:
        """Lines until one with `key` (the eavesdropper exits after 20 s without a socket event)."""
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            assert line, f"eavesdropper ended: {self.proc.stderr.read() if self.proc.stderr else ''}"
            msg = json.loads(line)
            if "got" in msg:
                self.got.append(msg)
            if key in msg:
                return msg[key]

    def stop(self) -> dict[str, int]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("stop\n")
        self.proc.stdin.flush()
        done = self.until("done")
        assert self.proc.wait(30) == 0
        return dict(done)


def _events_server(server_factory: Any, tmp_path: Path, *args: str) -> tuple[ServerProc, str, str, dict[str, str]]:
    tenants = tmp_path / "tenants.json"
    tokens = {
        name: subprocess.run(
            [str(BIN / "kvserver"), "tenant", "add", name, "--tenants-file", str(tenants)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for name in ("alice", "bob")
    }

    def start() -> tuple[ServerProc, str, str, dict[str, str]]:
        pub, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        srv = server_factory(
            "--l1-size-gb",
            "0.05",
            "--tenants-file",
            str(tenants),
            "--kv-events-endpoint",
            pub,
            "--kv-events-replay-endpoint",
            rep,
            *args,
        )
        return srv, pub, rep, tokens

    return with_fresh_ports(start)


def _alice_stores(srv: ServerProc, token: str) -> None:
    with Client(srv.url, token=token) as alice:
        ks, _ = register(alice, layouts=[tiny_layout()])
        stored = store(alice, ks, VICTIM, lambda ch, g: payload(ch, tiny_layout().object_bytes), salt="private")
        assert [slot["status"] for slot in stored["slots"]] == ["reserved", "reserved"]


def _has_victim(batches: list[Any]) -> bool:
    return any(ev["type"] == "BlockStored" and ev["token_ids"][0] == VICTIM[0] for b in batches for ev in b.events)


def test_a_stranger_and_a_tenant_read_no_events_while_the_owner_does(server_factory, tmp_path) -> None:
    _need_root()
    srv, pub, rep, tokens = _events_server(server_factory, tmp_path)
    stranger = Eavesdropper(pub, rep, "guess", tokens["bob"])  # bob is a tenant on another OS user
    try:
        assert set(stranger.until("handshakes").values()) == {"refused"}  # every socket, every credential
        creds = (PLAIN_USER, resolve_token(None, srv.url) or "")
        owner = Subscriber(pub, plain=creds)
        with srv.client() as admin:
            ks, _ = register(admin, layouts=[tiny_layout()])
            sync(owner, admin, ks, rep, plain=creds)
            _alice_stores(srv, tokens["alice"])
        owner.recv_until(_has_victim)  # the authenticated subscriber reads alice's prompt as token ids
        assert _has_victim(replay(rep, 0, plain=creds))
        owner.close()
    finally:
        received = stranger.stop()
    assert received == dict.fromkeys(received, 0) and stranger.got == [], stranger.got


def test_insecure_opens_the_event_sockets_and_then_a_stranger_reads_prompts(server_factory, tmp_path) -> None:
    """The control for the test above: the eavesdropper does read what an open socket sends."""
    _need_root()
    srv, pub, rep, tokens = _events_server(server_factory, tmp_path, "--insecure")
    stranger = Eavesdropper(pub, rep)
    try:
        assert set(stranger.until("handshakes").values()) == {"admitted"}
        with srv.client() as admin:
            ks, _ = register(admin, layouts=[tiny_layout()])
            owner = Subscriber(pub)
            sync(owner, admin, ks, rep)
            owner.close()
        _alice_stores(srv, tokens["alice"])
        while not any(VICTIM[0] in msg["tokens"] for msg in stranger.got if msg["got"].startswith("sub")):
            stranger.until("got")  # alice's prompt, as token ids
        while not any(msg["got"].startswith("replay") for msg in stranger.got):
            stranger.until("got")  # and the replay answers it too
    finally:
        stranger.stop()

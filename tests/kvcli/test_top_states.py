"""`kvcli top` against real servers: AUTH for a server refusing the token, the `/` filter, pause,
`?` help, colour thresholds (L1 full, stores refused, a tier down), p99 and engines that expire."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from typing import Any

from rich.text import Text
from textual.widgets import DataTable

from kvcli.top.app import HelpScreen, TopApp, screen_text
from kvcli.top.format import cells as format_cells
from kvcli.top.sources import DirectSource
from kvtestkit.kvhelpers import register, store, tiny_layout
from kvprotocol import Client, pack_tokens
from kvtestkit.serverproc import free_port
from test_top_pilot import SIZE, cells, until


def styled(app: TopApp, instance: str, column: str) -> Text:
    table = app.query_one("#instances", DataTable)
    value = table.get_cell(instance, column)
    assert isinstance(value, Text)
    return value


def has_style(text: Text, colour: str) -> bool:
    return any(colour in str(span.style) for span in text.spans) or colour in str(text.style)


async def test_a_server_refusing_the_token_is_auth_not_down(server_factory, monkeypatch, tmp_path) -> None:
    guarded = server_factory("--l1-size-gb", "0.02", "--api-token", "top-secret")
    monkeypatch.setenv("KVSERVER_STATE_DIR", str(tmp_path / "not-the-servers"))  # its token file: out of reach
    monkeypatch.delenv("KVSERVER_API_TOKEN", raising=False)
    monkeypatch.delenv("KVSERVER_API_TOKEN_FILE", raising=False)
    gone = f"tcp://127.0.0.1:{free_port()}"
    ida, idg = f"127.0.0.1:{guarded.port}", gone.removeprefix("tcp://")
    app = TopApp(DirectSource([guarded.url, gone], timeout=0.5), interval=0.3)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.fleet.polls >= 1)
        assert cells(app, ida)["state"] == "AUTH" and "--token" in cells(app, ida)["note"]
        assert cells(app, idg)["state"] == "DOWN"
        assert has_style(styled(app, ida, "state"), "magenta")
        assert "2 instances, 1 down, 1 AUTH" in screen_text(app)
    monkeypatch.setenv("KVSERVER_API_TOKEN", "top-secret")
    app = TopApp(DirectSource([guarded.url], timeout=0.5), interval=0.3)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.fleet.polls >= 1)
        assert cells(app, ida)["state"] == "up"


async def test_filter_pause_and_help_keys(server_factory) -> None:
    a, b = server_factory("--l1-size-gb", "0.02"), server_factory("--l1-size-gb", "0.02")
    with Client(b.url) as c:
        register(c, model="needle-model", layouts=[tiny_layout()])
    ida, idb = f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"
    app = TopApp(DirectSource([a.url, b.url], timeout=0.5), interval=0.2)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.fleet.polls >= 1)
        table = app.query_one("#instances", DataTable)
        await pilot.press("slash", *"needle")
        await until(pilot, lambda: table.row_count == 1)
        assert [str(k.value) for k in table.rows] == [idb]
        assert "filter: 'needle' (1 shown)" in screen_text(app)
        await pilot.press("enter")  # keeps the filter, back to the table
        await pilot.press("escape")  # clears it
        await until(pilot, lambda: table.row_count == 2)
        await pilot.press("p")
        assert app.paused and "PAUSED" in screen_text(app)
        polls = app.fleet.polls
        await pilot.pause(0.8)  # four intervals: no poll while paused
        assert app.fleet.polls == polls
        await pilot.press("p")
        await until(pilot, lambda: app.fleet.polls > polls)
        await pilot.press("question_mark")
        await until(pilot, lambda: isinstance(app.screen, HelpScreen))
        assert "AUTH" in screen_text(app) and "p99 ms" in screen_text(app)
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, HelpScreen))
        assert ida in [str(k.value) for k in table.rows]


async def test_thresholds_p99_and_tier_down(server_factory) -> None:
    dead_redis = f"redis://127.0.0.1:{free_port()}/0"
    srv = server_factory("--l1-size-gb", "0.002", "--l2", dead_redis, "--lease-ttl", "30")
    iid = f"127.0.0.1:{srv.port}"
    layout = tiny_layout(layers=4, block_bytes=8192)  # 256 KiB objects: 8 fill the 2 MiB L1
    app = TopApp(DirectSource([srv.url], timeout=1.0), interval=0.3, autopoll=False)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.fleet.polls >= 1)
        with Client(srv.url) as c:  # fill L1 with pinned objects: later stores are refused for space
            ks, _ = register(c, model="full-model", layouts=[layout])
            for i in range(16):
                tokens = list(range(i * 1000, i * 1000 + 256))
                store(c, ks, tokens, lambda ch, g: bytes(layout.object_bytes))
                c.call("pin", keyspace=ks.to_wire(), tokens=pack_tokens(tokens))
            await app.poll_now()  # the interval starts here
            for i in range(16, 24):
                store(c, ks, list(range(i * 1000, i * 1000 + 256)), lambda ch, g: bytes(layout.object_bytes))
            for _ in range(3):
                c.call("lookup", keyspace=ks.to_wire(), tokens=pack_tokens(list(range(256))))
        await app.poll_now()
        await pilot.pause()
        view, row = app.fleet.views[iid], cells(app, iid)
        assert view.l1_fraction is not None and view.l1_fraction >= 0.95
        assert has_style(styled(app, iid, "L1%"), "red")
        assert view.no_space_s and view.no_space_s > 0 and has_style(styled(app, iid, "nospace/s"), "red")
        assert view.p99_s is not None and row["p99 ms"] != "-"
        assert view.tiers_down == ["redis"] and has_style(styled(app, iid, "L2"), "red") and "redis↓" in row["L2"]
        assert row["note"].startswith("L2 redis down; stores refused")
        assert view.models == ["full-model"] and format_cells(view)["model"] == "full-model"


async def test_engines_that_exit_leave_the_dashboard(server_factory) -> None:
    srv = server_factory("--l1-size-gb", "0.02", "--lease-ttl", "1")
    iid = f"127.0.0.1:{srv.port}"
    code = (
        "import os, socket, sys; from kvprotocol import Client, LayoutDescriptor; "
        "lay = LayoutDescriptor('vllm_cpu', 'float32', 2, 32, 1024, 256, (256,)); "
        "c = Client(sys.argv[1]); c.call('register_engine', model='brief', world_size=1, rank=0, "
        "groups=[lay.to_wire()], host=socket.gethostname(), pid=os.getpid()); c.close()"
    )
    app = TopApp(DirectSource([srv.url], timeout=0.5), interval=0.3)
    async with app.run_test(size=SIZE) as pilot:
        subprocess.run([sys.executable, "-c", code, srv.url], check=True, timeout=60)
        await until(pilot, lambda: app.fleet.views.get(iid) is not None and app.fleet.views[iid].up)
        await until(pilot, lambda: app.fleet.views[iid].engines == 0, timeout=15)
        assert cells(app, iid)["engines"] == "0"


def test_coordinator_rows_refused_for_the_token_are_auth() -> None:
    from kvcli.top.sources import parse_fleet_status

    body = {
        "instances": [
            {
                "id": "a",
                "zmq_url": "tcp://10.0.0.1:5555",
                "status": None,
                "error": "HTTP 401: this endpoint needs a token",
            },
            {"id": "b", "zmq_url": "tcp://10.0.0.2:5555", "status": None, "error": "timeout after 2s"},
        ]
    }
    auth, down = parse_fleet_status(body, 0.0)
    assert auth.auth and not auth.up and not down.auth


class HeldSource:
    """A real DirectSource whose second poll returns only on `release`: a poll still out when the app closes
    (what failed once in CI: the answer came back after the app had removed its widgets)."""

    def __init__(self, inner: DirectSource) -> None:
        self.inner, self.label = inner, inner.label
        self.polls = 0
        self.waiting, self.release = threading.Event(), threading.Event()

    def poll(self) -> list[Any]:
        self.polls += 1
        snapshots = self.inner.poll()
        if self.polls > 1:  # polled while the app ran; it answers once the app has closed
            self.waiting.set()
            self.release.wait(10)
        return snapshots

    def close(self) -> None:
        self.inner.close()


async def test_a_poll_that_returns_after_the_app_closed_draws_nothing(server_factory) -> None:
    srv = server_factory("--l1-size-gb", "0.02")
    source = HeldSource(DirectSource([srv.url], timeout=0.5))
    app = TopApp(source, interval=0.3, autopoll=False)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.query_one("#instances", DataTable).row_count == 1)  # the first poll
        late = asyncio.create_task(app.poll_now())
        assert await asyncio.to_thread(source.waiting.wait, 10)
    # the app has closed its widgets and its source; the poll comes back only now
    source.release.set()
    await late  # no NoMatches for the table that is gone
    assert source.polls == 2

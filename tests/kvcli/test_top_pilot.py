"""`kvcli top` headless (Textual's run_test/Pilot) against real servers: rows, live rates, a killed
instance shown as down while the app keeps running, and every key in the footer."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvprotocol import Client
from textual.pilot import Pilot
from textual.widgets import DataTable

from kvcli.top.app import DetailScreen, TopApp, screen_text
from kvcli.top.sources import DirectSource
from kvtestkit.kvhelpers import register, store, tiny_layout

SIZE = (160, 40)


async def until(pilot: Pilot, cond: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await pilot.pause(0.05)


def cells(app: TopApp, instance: str) -> dict[str, str]:
    table = app.query_one("#instances", DataTable)
    columns = [str(c.label) for c in table.ordered_columns]
    return dict(zip(columns, (str(v) for v in table.get_row(instance)), strict=True))


def traffic(url: str, rounds: int = 3) -> None:
    """Store 4 chunks, then look them up (a hit) and some fresh tokens (a miss)."""
    layout = tiny_layout()
    with Client(url) as c:
        ks, _ = register(c, model="top-m", layouts=[layout])
        store(c, ks, list(range(1024)), lambda ch, g: bytes(layout.object_bytes))
        for i in range(rounds):
            c.call("lookup", keyspace=ks.to_wire(), tokens=_packed(range(1024)))
            c.call("lookup", keyspace=ks.to_wire(), tokens=_packed(range(5000 + i * 1024, 6024 + i * 1024)))


def _packed(tokens: range) -> bytes:
    from kvprotocol import pack_tokens

    return pack_tokens(list(tokens))


async def test_top_renders_updates_marks_down_and_keys(server_factory) -> None:
    a = server_factory("--l1-size-gb", "0.05")
    b = server_factory("--l1-size-gb", "0.05")
    ida, idb = f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"
    app = TopApp(DirectSource([a.url, b.url], timeout=0.5), interval=0.5)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.fleet.polls >= 1)
        table = app.query_one("#instances", DataTable)
        assert table.row_count == 2
        assert cells(app, ida)["state"] == "up" and cells(app, idb)["state"] == "up"
        assert cells(app, ida)["hit% all"] == "-"  # no lookups yet is not a 0% hit rate

        traffic(a.url)  # 3 hits of 1024 and 3 misses of 1024 tokens: 50%
        await until(
            pilot, lambda: app.fleet.views[ida].hit_rate_total is not None and (app.fleet.views[ida].ops_s or 0) > 0
        )
        row = cells(app, ida)
        assert row["hit% all"] == "50.0" and row["engines"] == "1" and row["L1 used"] != "-"
        assert float(row["ops/s"]) > 0
        assert app.fleet.history[-1].ops_s > 0 or any(p.ops_s > 0 for p in app.fleet.history)

        b.kill()
        await until(pilot, lambda: not app.fleet.views[idb].up)
        down = cells(app, idb)
        assert down["state"] == "DOWN" and ("refused" in down["note"] or "timeout" in down["note"])
        polls = app.fleet.polls
        await until(pilot, lambda: app.fleet.polls >= polls + 2)  # it keeps polling with one instance gone
        assert app.is_running and cells(app, ida)["state"] == "up"
        assert "2 instances, 1 down" in screen_text(app)

        # keys from the footer
        app.autopoll = False
        app._schedule()  # stop the timer so only keys drive polls from here
        polls = app.fleet.polls
        await pilot.press("r")
        await until(pilot, lambda: app.fleet.polls == polls + 1)
        await pilot.press("s")
        assert app.sort == "hit"
        assert [str(k.value) for k in table.rows] == [ida, idb]  # up before down under every sort but id
        await pilot.press("minus")
        assert app.interval == 1.0
        await pilot.press("plus", "plus")
        assert app.interval == 0.5 and "interval 0.5s" in screen_text(app)
        table.move_cursor(row=0)
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, DetailScreen))
        assert app.screen.instance_id == ida  # type: ignore[attr-defined]
        await pilot.pause()
        body = screen_text(app)
        assert f"{ida} is up" in body and "token hit rate      50.0% (3072 of 6144 tokens)" in body
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, DetailScreen))
        table.move_cursor(row=1)
        await pilot.press("d")
        await until(pilot, lambda: isinstance(app.screen, DetailScreen))
        await pilot.pause()
        assert f"{idb} is DOWN" in screen_text(app)
        await pilot.press("escape")
        await pilot.press("q")
    assert not app.is_running


async def test_top_follows_a_restarted_instance(server_factory) -> None:
    a = server_factory("--l1-size-gb", "0.05")
    ida = f"127.0.0.1:{a.port}"
    app = TopApp(DirectSource([a.url], timeout=0.5), interval=0.3)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.fleet.polls >= 1 and app.fleet.views[ida].up)
        a.stop()
        await until(pilot, lambda: not app.fleet.views[ida].up)
        a.start()
        await until(pilot, lambda: app.fleet.views[ida].up)
        assert cells(app, ida)["state"] == "up" and app.fleet.views[ida].uptime_s < 30

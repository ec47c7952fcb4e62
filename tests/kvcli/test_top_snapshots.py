"""Snapshot tests of `kvcli top`'s screens, replaying polls recorded from real servers
(data/top_recording.json, made by make_top_recording.py) so every run draws the same screen.

Update after an intended change of the screens: `uv run pytest tests/kvcli/test_top_snapshots.py --snapshot-update`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from textual.pilot import Pilot
from textual.widgets import DataTable

from kvcli.top.app import TopApp
from kvcli.top.sources import ReplaySource

RECORDING = Path(__file__).parent / "data" / "top_recording.json"
FRAMES = len(json.loads(RECORDING.read_text())["frames"])
SIZE = (150, 36)


def replay_app() -> TopApp:
    return TopApp(ReplaySource.from_file(RECORDING), interval=0.5, autopoll=False)


async def polled(pilot: Pilot, n: int, timeout: float = 30.0) -> None:
    """Until the app has drawn its n-th poll. A poll runs in a thread, and the app skips a poll asked
    for while one is still out: a key pressed before the mount's poll landed would do nothing (a
    busy host showed the first frame where the test expected the second)."""
    app = pilot.app
    assert isinstance(app, TopApp)
    deadline = time.monotonic() + timeout
    while app.fleet.polls < n:
        assert time.monotonic() < deadline, f"{app.fleet.polls} polls, not {n}"
        await pilot.pause(0.05)


def _tables_measured(app: TopApp) -> bool:
    """No DataTable still owes its column widths: Textual measures new rows when the table's own
    message queue next runs empty (`_on_idle`), which on a loaded host can come after the screen
    looked still for a while (snapshots caught addresses cut to "127.0.0." twice, 0.1 s apart)."""
    return not any(t._require_update_dimensions or t._updated_cells for t in app.query(DataTable))


async def settled(pilot: Pilot, timeout: float = 30.0) -> None:
    """The last poll drawn and the screen still: `pause()` alone waits for an idle CPU, which a host
    running engine tests beside this one may report early. So every table must have measured its
    rows, and then the screen must come out the same twice, 0.1 s apart."""
    app = pilot.app
    assert isinstance(app, TopApp)
    await pilot.wait_for_scheduled_animations()
    deadline = time.monotonic() + timeout
    shot = app.export_screenshot()
    while True:
        await pilot.pause(0.1)
        await pilot.pause()
        again = app.export_screenshot()
        if again == shot and _tables_measured(app):
            return
        shot = again
        assert time.monotonic() < deadline, "the screen never settled"
        shot = again


async def second_poll(pilot: Pilot) -> None:
    """The mount's poll, then the next one by key."""
    await polled(pilot, 1)
    await pilot.press("r")
    await polled(pilot, 2)
    await settled(pilot)


async def play_all(pilot: Pilot) -> None:
    """Advance through every recorded poll (the app polled the first one on mount; the last by key)."""
    app = pilot.app
    assert isinstance(app, TopApp)
    await polled(pilot, 1)
    for _ in range(FRAMES - 2):
        await app.poll_now()
    await pilot.press("r")
    await polled(pilot, FRAMES)
    await settled(pilot)
    assert app.fleet.polls == FRAMES


def test_dashboard_first_poll(snap_compare) -> None:
    async def first_poll(pilot: Pilot) -> None:
        await polled(pilot, 1)
        await pilot.pause()

    assert snap_compare(replay_app(), terminal_size=SIZE, run_before=first_poll)


def test_dashboard_after_recording_with_one_down(snap_compare) -> None:
    assert snap_compare(replay_app(), terminal_size=SIZE, run_before=play_all)


def test_dashboard_sorted_by_hit_rate(snap_compare) -> None:
    async def sort(pilot: Pilot) -> None:
        await play_all(pilot)
        await pilot.press("s")

    assert snap_compare(replay_app(), terminal_size=SIZE, run_before=sort)


def test_detail_screen(snap_compare) -> None:
    async def detail(pilot: Pilot) -> None:
        await play_all(pilot)
        await pilot.press("enter")
        await pilot.pause()

    assert snap_compare(replay_app(), terminal_size=SIZE, run_before=detail)


def test_detail_screen_of_down_instance(snap_compare) -> None:
    async def detail(pilot: Pilot) -> None:
        await play_all(pilot)
        await pilot.press("down", "d")
        await pilot.pause()

    assert snap_compare(replay_app(), terminal_size=SIZE, run_before=detail)


SMALL = (80, 24)


def test_dashboard_at_80x24_keeps_the_key_columns(snap_compare) -> None:
    assert snap_compare(replay_app(), terminal_size=SMALL, run_before=play_all)


def test_help_screen_at_80x24(snap_compare) -> None:
    async def help_screen(pilot: Pilot) -> None:
        await play_all(pilot)
        await pilot.press("question_mark")
        await pilot.pause()

    assert snap_compare(replay_app(), terminal_size=SMALL, run_before=help_screen)


def test_filtered_and_paused(snap_compare) -> None:
    async def filtered(pilot: Pilot) -> None:
        await play_all(pilot)
        await pilot.press("slash", *"DOWN", "enter", "p")
        await pilot.pause()

    assert snap_compare(replay_app(), terminal_size=SIZE, run_before=filtered)


def alerts_app() -> TopApp:
    """The recording's last two polls, changed: the down instance refuses our token (AUTH), and the
    busy one has an L2 tier down, writes dropped and stores refused for space."""
    import dataclasses

    frames = ReplaySource.from_file(RECORDING).frames[-2:]
    out = []
    for n, frame in enumerate(frames):
        snaps = []
        for snap in frame:
            if not snap.up:
                snap = dataclasses.replace(snap, auth=True, reason="describe refused: UNAUTHORIZED: bad token")
            elif snap.status and snap.status["l1"]["used_bytes"] > 0.9 * snap.status["l1"]["capacity_bytes"]:
                status = json.loads(json.dumps(snap.status))
                status["l2"] = [
                    {"tier": "fs", "url": "fs:///var/kv", "up": True, "dropped": 0, "errors": 0},
                    {"tier": "redis", "url": "redis://r:6379/0", "up": False, "dropped": 0, "errors": 7},
                ]
                status["l2_queue"] = {"queued": 12, "dropped": 40 * n}
                status["counters"]["no_space"] = 25 * n
                status["errors"] = {"NO_SPACE": 25 * n}
                snap = dataclasses.replace(snap, status=status)
            snaps.append(snap)
        out.append(snaps)
    return TopApp(ReplaySource(out, label="alerts"), interval=0.5, autopoll=False)


def test_auth_state_and_alert_colours(snap_compare) -> None:
    assert snap_compare(alerts_app(), terminal_size=SIZE, run_before=second_poll)


def test_auth_state_and_alerts_at_80x24(snap_compare) -> None:
    assert snap_compare(alerts_app(), terminal_size=SMALL, run_before=second_poll)

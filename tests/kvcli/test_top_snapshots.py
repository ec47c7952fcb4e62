"""Snapshot tests of `kvcli top`'s screens, replaying polls recorded from real servers
(data/top_recording.json, made by make_top_recording.py) so every run draws the same screen.

Update after an intended change of the screens: `uv run pytest tests/kvcli/test_top_snapshots.py --snapshot-update`.
"""

from __future__ import annotations

import json
from pathlib import Path

from textual.pilot import Pilot

from kvcli.top.app import TopApp
from kvcli.top.sources import ReplaySource

RECORDING = Path(__file__).parent / "data" / "top_recording.json"
FRAMES = len(json.loads(RECORDING.read_text())["frames"])
SIZE = (150, 36)


def replay_app() -> TopApp:
    return TopApp(ReplaySource.from_file(RECORDING), interval=0.5, autopoll=False)


async def play_all(pilot: Pilot) -> None:
    """Advance through every recorded poll (the app polled the first one on mount; the last by key)."""
    app = pilot.app
    assert isinstance(app, TopApp)
    for _ in range(FRAMES - 2):
        await app.poll_now()
    await pilot.press("r")
    await pilot.pause()
    assert app.fleet.polls == FRAMES


def test_dashboard_first_poll(snap_compare) -> None:
    assert snap_compare(replay_app(), terminal_size=SIZE)


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

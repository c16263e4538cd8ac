"""The backend view updates in place: values follow the ticks, the cursor stays, odd snapshots do not crash it."""

from __future__ import annotations

from typing import Any

from textual.widgets import DataTable

from llmdiag.agent.sources import ReplaySource
from llmdiag.cli.tui.app import TopApp
from llmdiag.cli.tui.screens import BackendScreen
from llmdiag.config import Config
from llmdiag.model import Snapshot

from tui_support import SteppingClock, fleet_backends, fleet_timeline, until


def _app(snapshots: list[Snapshot]) -> TopApp:
    source = ReplaySource(Config(), snapshots, backends=fleet_backends(), paused=True, monotonic=SteppingClock(),
                          description="replay of fleet fixture")
    return TopApp(source, toasts=False)


async def _step_to(pilot: Any, app: TopApp, tick: int) -> None:
    while app.model.ticks < tick:
        want = app.model.ticks + 1
        await pilot.press("n")
        await until(pilot, lambda: app.model.ticks == want)
    await pilot.pause()


def _signals(screen: BackendScreen) -> dict[str, list[str]]:
    table = screen.query_one("#signals", DataTable)
    return {str(row[0]): [str(c) for c in row] for row in (table.get_row_at(i) for i in range(table.row_count))}


async def test_values_follow_the_ticks_and_the_cursor_stays_put() -> None:
    app = _app(fleet_timeline())
    async with app.run_test(size=(120, 40)) as pilot:
        await _step_to(pilot, app, 38)
        app.push_screen(BackendScreen("vllm-1"))
        await until(pilot, lambda: isinstance(app.screen, BackendScreen))
        screen = app.screen
        assert isinstance(screen, BackendScreen)
        await pilot.pause()
        assert _signals(screen)["kv_cache_usage"][1] == "0.35"
        table = screen.query_one("#signals", DataTable)
        table.move_cursor(row=5)
        await _step_to(pilot, app, 42)  # KV fills at 40 s
        assert _signals(screen)["kv_cache_usage"][1] == "0.97"
        assert "kv_cache_usage" in _signals(screen)  # same rows, updated in place
        assert table.cursor_row == 5  # not back at the top on every tick


async def test_a_signal_shown_under_another_signals_name_does_not_crash_the_view() -> None:
    snapshots = fleet_timeline()[:5]
    for snap in snapshots:
        snap.backends["vllm-1"]["ttft_seconds.p50"] = 0.123  # next to the distribution ttft_seconds
    app = _app(snapshots)
    async with app.run_test(size=(120, 40)) as pilot:
        await _step_to(pilot, app, 2)
        app.push_screen(BackendScreen("vllm-1"))
        await until(pilot, lambda: isinstance(app.screen, BackendScreen))
        await _step_to(pilot, app, 4)
        screen = app.screen
        assert isinstance(screen, BackendScreen)
        table = screen.query_one("#signals", DataTable)
        names = [str(table.get_row_at(i)[0]) for i in range(table.row_count)]
        assert names.count("ttft_seconds.p50") == 2

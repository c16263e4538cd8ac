"""``llmdiag top`` driven by the Pilot over a fixed recording: messages and widget state first."""

from __future__ import annotations

import io
from typing import Any

import pytest
from rich.console import Console
from textual.message import Message
from textual.widgets import DataTable, Input, Static

from llmdiag.agent.sources import ReplaySource
from llmdiag.cli.tui.app import TopApp
from llmdiag.cli.tui.messages import DiagnosisOpened, SnapshotReceived, SourceEnded
from llmdiag.cli.tui.screens import BackendScreen, FleetScreen, HelpScreen, HostScreen, LogScreen
from llmdiag.config import Config

from tui_support import SteppingClock, fleet_backends, fleet_timeline, until


def _app(paused: bool = False) -> TopApp:
    source = ReplaySource(Config(), fleet_timeline(), backends=fleet_backends(), paused=paused,
                          monotonic=SteppingClock(), description="replay of fleet fixture")
    return TopApp(source, toasts=False)


def _rows(app: TopApp) -> list[str]:
    table = app.screen.query_one("#fleet", DataTable)
    return [str(table.get_row_at(i)[0]) for i in range(table.row_count)]


def _static_text(screen: Any, selector: str) -> str:
    """What a Static shows, as plain text (its content may be a string, markup or a rich renderable)."""
    content = screen.query_one(selector, Static).content
    if isinstance(content, str):
        return content
    console = Console(width=200, file=io.StringIO(), color_system=None)
    with console.capture() as capture:
        console.print(content)
    return capture.get()


async def test_fleet_view_shows_each_sick_backend_with_its_diagnosis() -> None:
    messages: list[Message] = []
    app = _app()
    async with app.run_test(size=(120, 40), message_hook=messages.append) as pilot:
        await until(pilot, lambda: app.ended)
        await pilot.pause()
        assert sum(isinstance(m, SnapshotReceived) for m in messages) == 66
        assert any(isinstance(m, SourceEnded) for m in messages)
        opened = {(m.diagnosis.backend, m.diagnosis.kind) for m in messages if isinstance(m, DiagnosisOpened)}
        assert {("vllm-1", "kv_cache_saturation"), ("vllm-2", "client_timeout_storm"),
                ("vllm-3", "timewait_exhaustion")} <= opened
        assert isinstance(app.screen, FleetScreen)
        # Default sort: lowest score first, so the drowning backends lead and the healthy one trails.
        rows = _rows(app)
        assert rows[-1] == "vllm-0"
        assert set(rows[:3]) == {"vllm-1", "vllm-2", "vllm-3"}
        table = app.screen.query_one("#fleet", DataTable)
        by_name = {str(table.get_row_at(i)[0]): table.get_row_at(i) for i in range(table.row_count)}
        assert "kv_cache_saturation" in str(by_name["vllm-1"][3])
        assert "client_timeout_storm" in str(by_name["vllm-2"][3])
        assert str(by_name["vllm-0"][3]) == "-"
        assert str(by_name["vllm-1"][1]) == "degraded"
        assert str(by_name["vllm-3"][12]) == "20000"  # TIME_WAIT towards it
        assert "end of data" in _static_text(app.screen, "#status")


async def test_sorting_and_filtering() -> None:
    app = _app()
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.ended)
        screen = app.screen
        assert isinstance(screen, FleetScreen)
        await pilot.press("s")
        assert screen.sort_key == "name"
        assert _rows(app) == ["vllm-0", "vllm-1", "vllm-2", "vllm-3"]
        await pilot.press("r")
        assert _rows(app) == ["vllm-3", "vllm-2", "vllm-1", "vllm-0"]
        await pilot.press("s")  # penalty, worst first
        assert screen.sort_key == "penalty"
        assert _rows(app)[0] == "vllm-2"
        await pilot.press("slash")
        box = screen.query_one("#filter", Input)
        assert box.display and box.has_focus
        await pilot.press(*"kv_cache")
        assert _rows(app) == ["vllm-1"]
        assert "1 of 4 backends" in _static_text(screen, "#summary")
        await pilot.press("enter", "escape")
        assert not box.display
        assert len(_rows(app)) == 4


async def test_opening_a_backend_shows_evidence_remediation_and_routing() -> None:
    app = _app()
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.ended)
        rows = _rows(app)
        table = app.screen.query_one("#fleet", DataTable)
        table.move_cursor(row=rows.index("vllm-1"))
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, BackendScreen))
        screen = app.screen
        assert isinstance(screen, BackendScreen) and screen.backend == "vllm-1"
        diagnoses = _static_text(screen, "#diagnoses")
        assert "kv_cache_saturation" in diagnoses and "kv_cache_usage" in diagnoses and "->" in diagnoses
        routing = _static_text(screen, "#routing")
        assert "DEGRADED" in routing and "kv_cache_saturation" in routing  # the balancer says why
        signals = screen.query_one("#signals", DataTable)
        names = [str(signals.get_row_at(i)[0]) for i in range(signals.row_count)]
        assert "kv_cache_usage" in names and "ttft_seconds.p99" in names
        kv = signals.get_row_at(names.index("kv_cache_usage"))
        assert str(kv[1]) == "0.97" and len(str(kv[2]).strip()) > 0  # value and its sparkline
        await pilot.press("escape")
        assert isinstance(app.screen, FleetScreen)


async def test_backend_view_shows_the_balancers_deadlines() -> None:
    import dataclasses
    from datetime import datetime, timezone

    app = _app()
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.ended)
        app.screen.query_one("#fleet", DataTable).move_cursor(row=_rows(app).index("vllm-1"))
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, BackendScreen))
        assert "until" not in _static_text(app.screen, "#routing")  # no deadlines in the replay
        state = app.model.state
        assert state is not None
        cooling_until, ejected_until = state.ts + 4.0, state.ts + 15.0
        entry = dataclasses.replace(state.backends["vllm-1"], cooling_until=cooling_until, ejected_until=ejected_until)
        app.post_message(SnapshotReceived(dataclasses.replace(state, backends={**state.backends, "vllm-1": entry}), [], []))
        await until(pilot, lambda: "cooling until" in _static_text(app.screen, "#routing"))
        routing = _static_text(app.screen, "#routing")

        def hms(ts: float) -> str:
            return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%H:%M:%S")

        assert f"cooling until {hms(cooling_until)} UTC (4 s left)" in routing
        assert f"ejected until {hms(ejected_until)} UTC (15 s left)" in routing


async def test_host_log_and_help_screens() -> None:
    app = _app()
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.ended)
        await pilot.press("h")
        assert isinstance(app.screen, HostScreen)
        dests = app.screen.query_one("#destinations", DataTable)
        assert str(dests.get_row_at(0)[0]) == "127.0.0.1:8003" and str(dests.get_row_at(0)[4]) == "20 s"
        gpus = app.screen.query_one("#gpus", DataTable)
        assert gpus.row_count == 4
        await pilot.press("l")
        assert isinstance(app.screen, LogScreen)
        log = app.screen.query_one("#log", DataTable)
        kinds = {str(log.get_row_at(i)[4]) for i in range(log.row_count)}
        assert {"kv_cache_saturation", "client_timeout_storm", "timewait_exhaustion"} <= kinds
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert isinstance(app.screen, LogScreen)
        await pilot.press("f")
        assert isinstance(app.screen, FleetScreen)


async def test_replay_pause_step_and_jump_to_next_diagnosis() -> None:
    messages: list[Message] = []
    app = _app(paused=True)
    async with app.run_test(size=(120, 40), message_hook=messages.append) as pilot:
        await pilot.pause(0.2)
        assert app.model.ticks == 0  # paused before the first tick
        assert "paused" in _static_text(app.screen, "#status")
        await pilot.press("n")
        await until(pilot, lambda: app.model.ticks == 1)
        await pilot.press("n")
        await until(pilot, lambda: app.model.ticks == 2)
        await pilot.pause(0.1)
        assert app.model.ticks == 2  # still paused after the steps
        await pilot.press("j")  # the first diagnosis opens at the 44th tick (vllm-1, KV)
        await until(pilot, lambda: any(isinstance(m, DiagnosisOpened) for m in messages))
        await pilot.pause(0.1)
        assert app.model.ticks == 44
        assert app.source.paused  # type: ignore[attr-defined]
        first = next(m for m in messages if isinstance(m, DiagnosisOpened))
        assert (first.diagnosis.backend, first.diagnosis.kind) == ("vllm-1", "kv_cache_saturation")
        await pilot.press("plus")
        assert app.source.speed == 2.0  # type: ignore[attr-defined]
        await pilot.press("minus", "minus")
        assert app.source.speed == 0.5  # type: ignore[attr-defined]
        await pilot.press("space")
        assert not app.source.paused  # type: ignore[attr-defined]
        await until(pilot, lambda: app.ended)
        assert app.model.ticks == 66


@pytest.mark.parametrize("size", [(120, 40), (80, 24)])
def test_fleet_snapshot(snap_compare: Any, size: tuple[int, int]) -> None:
    async def to_end(pilot: Any) -> None:
        await until(pilot, lambda: pilot.app.ended)
        await pilot.pause()

    assert snap_compare(_app(), terminal_size=size, run_before=to_end)


def test_backend_snapshot(snap_compare: Any) -> None:
    async def open_vllm2(pilot: Any) -> None:
        await until(pilot, lambda: pilot.app.ended)
        pilot.app.push_screen(BackendScreen("vllm-2"))
        await pilot.pause()

    assert snap_compare(_app(), terminal_size=(120, 40), run_before=open_vllm2)


def test_host_snapshot(snap_compare: Any) -> None:
    async def open_host(pilot: Any) -> None:
        await until(pilot, lambda: pilot.app.ended)
        await pilot.press("h")
        await pilot.pause()

    assert snap_compare(_app(), terminal_size=(120, 40), run_before=open_host)


async def test_mouse_click_selects_then_opens_a_backend() -> None:
    app = _app()
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.ended)
        table = app.screen.query_one("#fleet", DataTable)
        second = _rows(app)[1]
        await pilot.click("#fleet", offset=(3, 2))  # header is row 0: this is the second backend
        await pilot.pause()
        assert table.cursor_row == 1
        await pilot.click("#fleet", offset=(3, 2))  # a click on the selected row opens it
        await until(pilot, lambda: isinstance(app.screen, BackendScreen))
        assert app.screen.backend == second  # type: ignore[attr-defined]

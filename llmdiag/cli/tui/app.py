"""The ``llmdiag top`` Textual app.

The app gets its data source as an object (:class:`~llmdiag.agent.sources.StateSource`)
and never reaches past it. One thread worker blocks on ``source.read()`` and
posts past-tense messages (:class:`SnapshotReceived`, :class:`DiagnosisOpened`,
:class:`DiagnosisClosed`, :class:`SourceEnded`); the UI thread only ingests
them into the :class:`~llmdiag.cli.tui.model.TopModel` and redraws the screen
on top.
"""

from __future__ import annotations

from textual import work
from textual.app import App, ScreenStackError
from textual.binding import Binding
from textual.worker import get_current_worker

from llmdiag.agent.sources import ReplaySource, StateSource, diagnosis_changes
from llmdiag.cli.tui.messages import DiagnosisClosed, DiagnosisOpened, SnapshotReceived, SourceEnded, SourceFailed
from llmdiag.cli.tui.model import TopModel
from llmdiag.cli.tui.screens import FleetScreen, HelpScreen, HostScreen, LogScreen, utc

__all__ = ["TopApp"]


class TopApp(App[None]):
    """Fleet, backend, host and log views over one :class:`StateSource`."""

    TITLE = "llmdiag top"
    CSS = """
    .status { height: 1; background: $boost; color: $text; padding: 0 1; text-style: bold; }
    .summary { height: 1; padding: 0 1; color: $text-muted; }
    .panel { padding: 0 1; margin-bottom: 1; }
    .heading { padding: 0 1; text-style: bold; }
    #fleet { height: 1fr; }
    #filter { height: 3; }
    #help { width: 84; height: auto; max-height: 90%; border: round $accent; padding: 0 1; background: $panel; }
    HelpScreen { align: center middle; }
    """
    MODES = {"fleet": FleetScreen, "host": HostScreen, "log": LogScreen}
    DEFAULT_MODE = "fleet"
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("question_mark", "help", "Help"),
        Binding("f", "switch_mode('fleet')", "Fleet"),
        Binding("h", "switch_mode('host')", "Host"),
        Binding("l", "switch_mode('log')", "Log"),
        Binding("space", "toggle_pause", "Pause", show=False),
        Binding("n", "step", "Step", show=False),
        Binding("j", "jump", "Next diagnosis", show=False),
        Binding("plus,equals_sign", "faster", "Faster", show=False),
        Binding("minus", "slower", "Slower", show=False),
    ]

    def __init__(self, source: StateSource, *, toasts: bool = True) -> None:
        super().__init__()
        self.source = source
        self.toasts = toasts  # pop-ups on new diagnoses (off for SVG snapshots: they expire by the wall clock)
        self.model = TopModel()
        self.ended = False
        self.error: str | None = None

    # -- life cycle ------------------------------------------------------------------
    def on_mount(self) -> None:
        self._read_source()

    def on_unmount(self) -> None:
        self.source.close()

    @work(thread=True, exclusive=True, name="source", exit_on_error=False)
    def _read_source(self) -> None:
        worker = get_current_worker()
        previous = None
        try:
            while not worker.is_cancelled:
                state = self.source.read()
                if state is None:
                    self.post_message(SourceEnded())
                    return
                opened, closed = diagnosis_changes(previous, state)
                previous = state
                self.post_message(SnapshotReceived(state, opened, closed))
                for d in opened:
                    self.post_message(DiagnosisOpened(d, state.ts))
                for d in closed:
                    self.post_message(DiagnosisClosed(d, state.ts))
        except Exception as exc:  # noqa: BLE001 - shown in the UI; the app keeps what it has
            self.post_message(SourceFailed(f"{type(exc).__name__}: {exc}"))

    # -- messages ----------------------------------------------------------------------
    def on_snapshot_received(self, message: SnapshotReceived) -> None:
        self.model.ingest(message.state, message.opened, message.closed)
        self._redraw()

    def on_diagnosis_opened(self, message: DiagnosisOpened) -> None:
        d = message.diagnosis
        if not self.toasts:
            return
        self.notify(f"{d.severity.value}: {d.kind} on {d.backend}",
                    severity="error" if d.severity.value == "critical" else "warning", timeout=4)

    def on_source_ended(self, message: SourceEnded) -> None:
        self.ended = True
        self._redraw()

    def on_source_failed(self, message: SourceFailed) -> None:
        self.error = message.error
        self._redraw()

    def _redraw(self) -> None:
        try:
            screen = self.screen
        except ScreenStackError:  # a tick that arrives while the app shuts down
            return
        refresh = getattr(screen, "refresh_from", None)
        if refresh is not None and screen.is_mounted:
            refresh(self.model)

    # -- status line ------------------------------------------------------------------
    def status_line(self) -> str:
        """Play state first (it must survive an 80-column terminal), then when, where and what."""
        state = self.model.state
        parts = [f"tick {self.model.ticks}" if state is not None else "waiting for the first tick..."]
        if isinstance(self.source, ReplaySource):
            parts.append(("paused" if self.source.paused else "playing") + f" x{self.source.speed:g}")
        if self.ended:
            parts.append("end of data")
        if self.error:
            parts.append(f"source failed: {self.error}")
        elif getattr(self.source, "error", None):
            parts.append(f"agent unreachable: {self.source.error}")  # type: ignore[attr-defined]
        if state is not None:
            parts.append(f"{utc(state.ts)} · {state.host or '?'}")
        parts.append(self.source.description)
        return " · ".join(parts) + " · ? help"

    # -- actions ------------------------------------------------------------------------
    def action_help(self) -> None:
        if isinstance(self.screen, HelpScreen):
            self.pop_screen()
        else:
            self.push_screen(HelpScreen())

    def _replay(self) -> ReplaySource | None:
        if isinstance(self.source, ReplaySource):
            return self.source
        self.notify("replay controls work with --replay FILE", timeout=3)
        return None

    def action_toggle_pause(self) -> None:
        if (replay := self._replay()) is not None:
            replay.toggle_pause()
            self._redraw()

    def action_step(self) -> None:
        if (replay := self._replay()) is not None:
            replay.step()
            self._redraw()

    def action_jump(self) -> None:
        if (replay := self._replay()) is not None:
            replay.jump_to_next_diagnosis()

    def action_faster(self) -> None:
        if (replay := self._replay()) is not None:
            replay.set_speed(replay.speed * 2)
            self._redraw()

    def action_slower(self) -> None:
        if (replay := self._replay()) is not None:
            replay.set_speed(replay.speed / 2)
            self._redraw()

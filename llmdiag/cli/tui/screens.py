"""The screens of ``llmdiag top``: fleet, backend, host, diagnosis log and help.

Each screen formats what :class:`~llmdiag.cli.tui.model.TopModel` holds in
``refresh_from(model)``, which the app calls on every tick for the screen on
top (and a screen calls for itself when it comes back on top). Text carries
the meaning (state names, ``!!``/``!`` severity marks), colour only repeats
it, so the UI reads in monochrome.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from rich.cells import cell_len
from rich.console import Group
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import DataTable, Footer, Input, Static
from textual.widgets.data_table import ColumnKey

from llmdiag.cli.report import diagnosis_renderable
from llmdiag.cli.tui.model import FleetRow, TopModel, fmt, number, sparkline
from llmdiag.cli.tui.table import IncrementalDataTable
from llmdiag.model import HOST, Distribution, Labelled, Severity

if TYPE_CHECKING:
    from llmdiag.cli.tui.app import TopApp

__all__ = ["BackendScreen", "FleetScreen", "HelpScreen", "HostScreen", "LogScreen", "utc"]

_MARK = {Severity.CRITICAL: "!!", Severity.WARNING: "! ", Severity.INFO: "· "}
_SEV_STYLE = {Severity.CRITICAL: "bold red", Severity.WARNING: "yellow", Severity.INFO: "cyan"}
_STATE_STYLE = {"healthy": "green", "degraded": "yellow", "cooling": "yellow", "ejected": "bold red",
                "half_open": "magenta", "warming": "cyan"}


def utc(ts: float | None, with_date: bool = True) -> str:
    if ts is None:
        return "-"
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ" if with_date else "%H:%M:%S")


class _Base(Screen[None]):
    """A screen with the status line on top and the footer at the bottom."""

    _status_shown = ""

    def compose_status(self) -> ComposeResult:
        yield Static("", id="status", classes="status")

    def update_status(self, model: TopModel) -> None:
        app: TopApp = self.app  # type: ignore[assignment]
        status = app.status_line()
        widget = self.query_one("#status", Static)
        if status != self._status_shown:
            # One line, fixed height: no layout pass (a full reflow every tick is most of the cost).
            widget.update(status, layout=False)
            self._status_shown = status

    def refresh_from(self, model: TopModel) -> None:  # pragma: no cover - every screen overrides it
        self.update_status(model)

    def on_screen_resume(self) -> None:
        app: TopApp = self.app  # type: ignore[assignment]
        self.refresh_from(app.model)


class FleetScreen(_Base):
    """A row per backend, worst first by default; sortable (``s``, ``r``) and filterable (``/``)."""

    BINDINGS = [
        Binding("s", "cycle_sort", "Sort"),
        Binding("r", "reverse_sort", "Reverse", show=False),
        Binding("slash", "filter", "Filter"),
        Binding("escape", "clear_filter", "Clear filter", show=False),
    ]

    COLUMNS = (
        ("backend", "name"), ("state", "state"), ("score", "score"), ("diagnosis", "diagnosis"),
        ("penalty", "penalty"), ("weight", "weight_percent"), ("TTFT p50", "ttft_p50"), ("TTFT p99", "ttft_p99"),
        ("wait", "waiting"), ("KV", "kv"), ("GPU", "gpu_util"), ("GPU mem", "gpu_mem"), ("TIME_WAIT", "timewait"),
        ("RST/s", "rst_per_s"), ("retx/s", "retrans_per_s"),
    )

    def __init__(self) -> None:
        super().__init__()
        self.sort_key = "score"
        self.sort_reverse = False
        self.filter_text = ""
        self._shown: list[str] = []  # row keys in the table, in order
        self._cells_shown: dict[str, list[Any]] = {}
        self._signatures: dict[str, tuple[Any, ...]] = {}
        self._summary_shown = ""

    def compose(self) -> ComposeResult:
        yield from self.compose_status()
        yield Input(placeholder="filter: part of a backend name, state or diagnosis (Esc clears)", id="filter")
        # Rows rarely change all at once: redraw the changed cells, not all 64 x 15.
        table = IncrementalDataTable(id="fleet", cursor_type="row", zebra_stripes=False)
        yield table
        yield Static("", id="summary", classes="summary")
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one("#fleet", DataTable)
        for label, key in self.COLUMNS:
            table.add_column(label, key=key)
        self.query_one("#filter", Input).display = False
        table.focus()

    # -- actions ---------------------------------------------------------------------
    def action_cycle_sort(self) -> None:
        keys = FleetRow.SORT_KEYS
        self.sort_key = keys[(keys.index(self.sort_key) + 1) % len(keys)] if self.sort_key in keys else keys[0]
        # Numbers where high is bad read worst-first descending; score and name ascending.
        self.sort_reverse = self.sort_key not in ("score", "name")
        self.refresh_from(self._model())

    def action_reverse_sort(self) -> None:
        self.sort_reverse = not self.sort_reverse
        self.refresh_from(self._model())

    def action_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.display = True
        box.focus()

    def action_clear_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.value = ""
        box.display = False
        self.filter_text = ""
        self.query_one("#fleet", DataTable).focus()
        self.refresh_from(self._model())

    def on_input_changed(self, event: Input.Changed) -> None:
        self.filter_text = event.value.strip().lower()
        self.refresh_from(self._model())

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.query_one("#fleet", DataTable).focus()

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        if event.row_key.value:
            self.app.push_screen(BackendScreen(event.row_key.value))

    # -- drawing -----------------------------------------------------------------------
    def _model(self) -> TopModel:
        return self.app.model  # type: ignore[attr-defined, no-any-return]

    def visible_rows(self, model: TopModel) -> list[FleetRow]:
        rows = model.rows()
        if self.filter_text:
            rows = [r for r in rows if self.filter_text in f"{r.name} {r.state} {r.diagnosis}".lower()]
        if self.sort_key == "name":
            rows.sort(key=lambda r: r.name, reverse=self.sort_reverse)
        else:
            known = [r for r in rows if r.sort_value(self.sort_key)[0] == 0]
            unknown = [r for r in rows if r.sort_value(self.sort_key)[0] == 1]
            known.sort(key=lambda r: (r.sort_value(self.sort_key)[1], r.name), reverse=self.sort_reverse)
            rows = known + sorted(unknown, key=lambda r: r.name)
        return rows

    def refresh_from(self, model: TopModel) -> None:
        self.update_status(model)
        table = self.query_one("#fleet", IncrementalDataTable)
        # The cursor keeps its row position (as in top(1)): the worst backend stays under it by default.
        position = table.cursor_row if table.row_count else 0
        rows = self.visible_rows(model)
        names = [r.name for r in rows]
        if names == self._shown or (len(names) == len(self._shown) and set(names) == set(self._shown)):
            # Same rows (most ticks): rewrite only the cells that changed, then move the rows that moved.
            for row in rows:
                spark = model.series(row.name, "score", last=8)
                signature = (row, tuple(spark))
                if self._signatures.get(row.name) == signature:
                    continue  # nothing in this row changed: no cell objects, no repaint
                self._signatures[row.name] = signature
                cells = self._cells(row, model)
                old = self._cells_shown.get(row.name)
                for (_, key), cell, before in zip(self.COLUMNS, cells, old or [None] * len(cells)):
                    if str(cell) != str(before) or getattr(cell, "style", None) != getattr(before, "style", None):
                        # update_width: a column grows to fit a wider value (else "degraded" shows
                        # as "degra" when the row was first added while "healthy").
                        table.update_cell(row.name, key, cell, update_width=True)
                self._cells_shown[row.name] = cells
            if names != self._shown:
                # A backend changed places (it got worse): reorder, not rebuild; rows that keep their
                # place stay drawn, and the cursor stays on its row position as after a rebuild.
                table.reorder(names)
                self._shown = names
                table.move_cursor(row=min(max(position, 0), len(rows) - 1), animate=False)
        else:
            table.clear()
            self._cells_shown = {}
            self._signatures = {}
            for row in rows:
                cells = self._cells(row, model)
                table.add_row(*cells, key=row.name)
                self._cells_shown[row.name] = cells
            self._shown = names
            if rows:
                table.move_cursor(row=min(max(position, 0), len(rows) - 1), animate=False)
        table.settle_widths()  # this tick's widths in this tick's frame (not on a later Idle)
        state = model.state
        n_open = len([d for d in state.open if d.backend != HOST]) if state else 0
        crit = len([d for d in state.open if d.severity is Severity.CRITICAL]) if state else 0
        host_open = [d for d in state.open if d.backend == HOST] if state else []
        shown = f"{len(rows)} of {len(model.rows())}" if self.filter_text else f"{len(rows)}"
        summary = (f"{shown} backends · {n_open} open diagnoses ({crit} critical)"
                   f"{' · host: ' + ', '.join(d.kind for d in host_open) if host_open else ''}"
                   f" · sort {self.sort_key}{' desc' if self.sort_reverse else ''}"
                   f"{' · filter ' + repr(self.filter_text) if self.filter_text else ''}")
        if summary != self._summary_shown:
            self.query_one("#summary", Static).update(summary, layout=False)
            self._summary_shown = summary

    def _cells(self, row: FleetRow, model: TopModel) -> list[Any]:
        state = Text(row.state if row.up is not False else f"{row.state} DOWN",
                     style=_STATE_STYLE.get(row.state, "") if row.up is not False else "bold red")
        spark = sparkline(model.series(row.name, "score", last=8), 8, lo=0.0, hi=100.0)
        diag = Text(f"{_MARK[row.severity]}{row.diagnosis}" if row.severity else "-",
                    style=_SEV_STYLE[row.severity] if row.severity else "dim")
        plain = [
            f"{fmt(row.score, '3.0f')} {spark}", fmt(row.penalty, ".2f"),
            fmt(None if row.weight_percent is None else float(row.weight_percent), ".0f", "%"),
            fmt(row.ttft_p50, ".2f", "s"), fmt(row.ttft_p99, ".2f", "s"), fmt(row.waiting, ".0f"), fmt(row.kv, "%"),
            fmt(row.gpu_util, "%"), fmt(row.gpu_mem, "%"), fmt(row.timewait, ".0f"), fmt(row.rst_per_s, ".1f"),
            fmt(row.retrans_per_s, ".1f"),
        ]
        # Text, not str: the table would parse every str cell as markup (and emoji codes) on each
        # redraw of its row; this is the Text that parse gives for these markup-free strings.
        score, penalty, weight, *rest = (Text(v, end="", no_wrap=True) for v in plain)
        return [Text(row.name, style="bold"), state, score, diag, penalty, weight, *rest]


class BackendScreen(_Base):
    """One backend: routing state and why, diagnoses with evidence, every signal with a sparkline."""

    BINDINGS = [Binding("escape,backspace", "app.pop_screen", "Back")]

    def __init__(self, backend: str) -> None:
        super().__init__()
        self.backend = backend
        # What each part shows now: a part whose inputs did not change is not rebuilt (a Static
        # update reflows the scrolling body; a cleared table re-renders every row).
        self._routing_shown: Any = None
        self._diagnoses_shown: Any = None
        self._signal_rows: dict[str, tuple[str, str, str]] = {}

    def compose(self) -> ComposeResult:
        yield from self.compose_status()
        with VerticalScroll(id="backend-body"):
            yield Static("", id="routing", classes="panel")
            yield Static("", id="diagnoses", classes="panel")
            yield IncrementalDataTable(id="signals", cursor_type="row")
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one("#signals", DataTable)
        table.add_column("signal", key="signal")
        table.add_column("value", key="value")
        table.add_column("last 30 ticks", key="spark")

    def refresh_from(self, model: TopModel) -> None:
        self.update_status(model)
        state = model.state
        if state is None:
            return
        routing = state.backends.get(self.backend)
        # The "s left" of a deadline moves with the tick time; nothing else here does.
        deadline = routing is not None and (routing.cooling_until is not None or routing.ejected_until is not None)
        routing_inputs = (routing, state.ts if deadline else None)
        if routing_inputs != self._routing_shown:
            self.query_one("#routing", Static).update(self._routing_body(routing, state.ts))
            self._routing_shown = routing_inputs
        open_now = model.open_for(self.backend)
        recent = [e for e in state.closed if e.diagnosis.backend == self.backend][-3:]
        if (open_now, recent) != self._diagnoses_shown:
            parts: list[Any] = [diagnosis_renderable(d) for d in open_now]
            for e in reversed(recent):
                parts.append(diagnosis_renderable(e.diagnosis, closed_at=e.closed_at, enforced=e.enforced))
            if not parts:
                parts.append(Text("no open or recent diagnoses", style="green"))
            self.query_one("#diagnoses", Static).update(Group(Text("diagnoses", style="bold"), *parts))
            self._diagnoses_shown = (open_now, recent)
        self._refresh_signals(model)

    def _routing_body(self, routing: Any, now: float) -> Group:
        head = Text()
        head.append(self.backend, style="bold underline")
        if routing is None:
            return Group(head, Text("not routed by the balancer"))
        head.append(f"  {routing.address}  " if routing.address else "  ")
        head.append(routing.state.value.upper(), style=_STATE_STYLE.get(routing.state.value, ""))
        head.append(f"  score {routing.score:.0f}  penalty {routing.penalty:.2f}  weight {routing.weight_percent}%")
        why = [f"  {r.kind}: {r.summary} (penalty {r.penalty:.2f})" for r in routing.reasons]
        if routing.cooling_until is not None:
            why.append(f"  cooling until {utc(routing.cooling_until, False)} UTC ({routing.cooling_until - now:.0f} s left)")
        if routing.ejected_until is not None:
            why.append(f"  ejected until {utc(routing.ejected_until, False)} UTC ({routing.ejected_until - now:.0f} s left)")
        if routing.state.value == "warming":
            why.append("  warming: new or restarted, its share of traffic ramps up")
        return Group(head, Text("balancer: " + ("why:" if why else "nothing against it")), *[Text(w) for w in why])

    def _signal_rows_now(self, model: TopModel) -> list[tuple[str, str, str]]:
        rows = []
        signals = model.snapshot.backends.get(self.backend, {})
        for name in sorted(signals):
            value = signals[name]
            if isinstance(value, Distribution):
                for stat in ("p50", "p99"):
                    rows.append((f"{name}.{stat}", fmt(number(value, stat), ".3g"),
                                 sparkline(model.series(self.backend, f"{name}.{stat}", last=30), 30)))
            elif name.endswith("_total"):
                # Counters read as rates: a cumulative count says little at 3 a.m.
                series = model.series(self.backend, name, last=30)
                rows.append((f"{name} /s", fmt(series[-1] if series else None, ".3g"), sparkline(series, 30)))
            else:
                rows.append((name, _value_text(value), sparkline(model.series(self.backend, name, last=30), 30)))
        return rows

    def _refresh_signals(self, model: TopModel) -> None:
        table = self.query_one("#signals", IncrementalDataTable)
        rows = self._signal_rows_now(model)
        names = [r[0] for r in rows]
        if len(set(names)) != len(names):
            # Two signals shown under one name (a signal "x.p50" next to a distribution "x"): rows
            # without keys, rebuilt every tick as before; no crash on an odd snapshot.
            table.clear()
            for row in rows:
                table.add_row(*row)
            self._signal_rows = {}
            return
        if names != list(self._signal_rows):
            table.clear()
            for row in rows:
                table.add_row(*row, key=row[0])
            self._signal_rows = {row[0]: row for row in rows}
            return
        # Same signals as shown (most ticks): rewrite the cells that changed. A column only grows,
        # as it did when the table was rebuilt every tick (added rows widen it, never narrow it).
        for row in rows:
            before = self._signal_rows[row[0]]
            for key, new, old in (("value", row[1], before[1]), ("spark", row[2], before[2])):
                if new != old:
                    wider = cell_len(new) > table.columns[ColumnKey(key)].content_width
                    table.update_cell(row[0], key, new, update_width=wider)
            self._signal_rows[row[0]] = row
        table.settle_widths()


def _value_text(value: Any) -> str:
    if isinstance(value, Labelled):
        if not value:
            return "-"
        parts = [f"{k or 'total'}={v:g}" for k, v in sorted(value.items())[:3]]
        return ", ".join(parts) + (f" (+{len(value) - 3})" if len(value) > 3 else "")
    return fmt(number(value), ".4g")


class HostScreen(_Base):
    """GPUs (throttle reasons, XIDs), pressure stall, TIME_WAIT per destination with the exhaustion ETA, conntrack."""

    BINDINGS = [Binding("escape", "app.switch_mode('fleet')", "Fleet")]

    def compose(self) -> ComposeResult:
        yield from self.compose_status()
        with VerticalScroll():
            yield Static("", id="host-signals", classes="panel")
            yield Static("GPUs", classes="heading")
            yield DataTable(id="gpus", cursor_type="row")
            yield Static("TIME_WAIT per destination", classes="heading")
            yield DataTable(id="destinations", cursor_type="row")
            yield Static("collectors", classes="heading")
            yield DataTable(id="collectors", cursor_type="row")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#gpus", DataTable).add_columns("gpu", "util", "memory", "power", "temp", "throttle", "XIDs")
        self.query_one("#destinations", DataTable).add_columns("destination", "TIME_WAIT", "entries/s", "ports free", "ETA")
        self.query_one("#collectors", DataTable).add_columns("collector", "status", "reason")

    def refresh_from(self, model: TopModel) -> None:
        self.update_status(model)
        state = model.state
        if state is None:
            return
        snap = model.snapshot
        h = snap.host
        conn, conn_max = number(h.get("conntrack_entries")), number(h.get("conntrack_max"))
        lines = Text()
        lines.append("pressure stall (avg10): ", style="bold")
        lines.append(f"cpu some {fmt(number(h.get('psi_cpu_some_avg10')), '.2f')}  io some {fmt(number(h.get('psi_io_some_avg10')), '.2f')}"
                     f"  io full {fmt(number(h.get('psi_io_full_avg10')), '.2f')}  memory full {fmt(number(h.get('psi_memory_full_avg10')), '.2f')}"
                     f"  {sparkline(model.series('host', 'psi_io_full_avg10', last=20), 20)}\n")
        lines.append("sockets: ", style="bold")
        lines.append(f"tcp in use {fmt(number(h.get('sockstat_tcp_inuse')), '.0f')}  TIME_WAIT {fmt(number(h.get('sockstat_tcp_tw')), '.0f')}"
                     f"  {sparkline(model.series('host', 'sockstat_tcp_tw', last=20), 20)}\n")
        lines.append("conntrack: ", style="bold")
        lines.append(f"{fmt(conn, '.0f')} of {fmt(conn_max, '.0f')}" + (f" ({conn / conn_max:.0%})" if conn is not None and conn_max else ""))
        host_diags = [d for d in state.open if d.backend == HOST]
        for d in host_diags:
            lines.append(f"\n{_MARK[d.severity]}{d.kind}: {d.summary}", style=_SEV_STYLE[d.severity])
        self.query_one("#host-signals", Static).update(lines)
        gpus = self.query_one("#gpus", DataTable)
        gpus.clear()
        for index in sorted(snap.gpus, key=lambda g: (len(g), g)):
            g = snap.gpus[index]
            used, total = number(g.get("memory_used_bytes")), number(g.get("memory_total_bytes"))
            throttle = g.get("throttle_reasons")
            reasons = ", ".join(sorted(k for k, v in throttle.items() if v)) if isinstance(throttle, Labelled) else ""
            xids = g.get("xid_errors_total")
            xid_text = ", ".join(f"{k.split('=', 1)[-1]}:{v:g}" for k, v in sorted(xids.items()) if v) if isinstance(xids, Labelled) else ""
            gpus.add_row(index, fmt(number(g.get("gpu_utilization")), "%"),
                         f"{fmt(used and used / 2**30, '.0f')}/{fmt(total and total / 2**30, '.0f')} GiB",
                         fmt(number(g.get("power_watts")), ".0f", " W"), fmt(number(g.get("temperature_celsius")), ".0f", " C"),
                         reasons or "-", xid_text or "-")
        dests = self.query_one("#destinations", DataTable)
        dests.clear()
        for dest, s in sorted(snap.destinations.items(), key=lambda kv: -(number(kv[1].get("timewait_sockets")) or 0)):
            eta = number(s.get("port_exhaustion_eta_seconds"))
            dests.add_row(dest, fmt(number(s.get("timewait_sockets")), ".0f"), fmt(number(s.get("timewait_entry_rate")), ".1f"),
                          fmt(number(s.get("ephemeral_ports_available")), ".0f"), fmt(eta, ".0f", " s"))
        collectors = self.query_one("#collectors", DataTable)
        collectors.clear()
        for name, st in sorted(state.collectors.items()):
            collectors.add_row(name, st.status.value, st.reason or "")


class LogScreen(_Base):
    """Every diagnosis that opened or closed, newest first."""

    BINDINGS = [Binding("escape", "app.switch_mode('fleet')", "Fleet")]

    def compose(self) -> ComposeResult:
        yield from self.compose_status()
        yield DataTable(id="log", cursor_type="row")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#log", DataTable).add_columns("time", "event", "severity", "backend", "kind", "summary")

    def refresh_from(self, model: TopModel) -> None:
        self.update_status(model)
        table = self.query_one("#log", DataTable)
        table.clear()
        for e in reversed(model.log):
            d = e.diagnosis
            table.add_row(utc(e.ts, with_date=False), e.event, Text(d.severity.value, style=_SEV_STYLE[d.severity]),
                          d.backend, d.kind, d.summary)


HELP = """\
[b]llmdiag top[/b]: which backend is drowning, why, and what routing does about it

[b]Everywhere[/b]
  f  fleet view          h  host view           l  diagnosis log
  ?  this help           q  quit
[b]Fleet view[/b]
  ↑ ↓  move              Enter  open the backend (signals, diagnoses, routing)
  s  next sort column    r  reverse the sort    /  filter (Esc clears)
[b]Backend view[/b]
  Esc  back to the fleet
[b]Replay[/b] (llmdiag top --replay FILE)
  space  pause/resume    n  one tick (pauses)   j  jump to the next diagnosis
  +  faster              -  slower

Severity marks: !! critical, ! warning, · info. States: healthy, degraded,
cooling, ejected, half_open, warming. Mouse: click a row to select, again to open.
Press Esc or ? to close."""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,question_mark,q", "app.pop_screen", "Close")]

    def compose(self) -> ComposeResult:
        with Vertical(id="help"):
            yield Static(HELP, id="help-text")

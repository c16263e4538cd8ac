"""``IncrementalDataTable``: draws exactly what Textual's ``DataTable`` draws, re-rendering only what changed."""

from __future__ import annotations

import random
from typing import Any

import pytest
from rich.text import Text
from textual.app import App, ComposeResult
from textual.geometry import Region
from textual.widgets import DataTable
from textual.widgets.data_table import ColumnKey

from llmdiag.cli.tui.table import IncrementalDataTable

COLUMNS = ("name", "state", "score", "waiting")
WIDTH, HEIGHT = 60, 12


class _Pair(App[None]):
    """The same rows in a plain DataTable and in an IncrementalDataTable (neither focused: same styles)."""

    AUTO_FOCUS = None

    def compose(self) -> ComposeResult:
        yield DataTable(id="plain", cursor_type="row")
        yield IncrementalDataTable(id="incremental", cursor_type="row")

    def on_mount(self) -> None:
        for table in self.tables():
            for column in COLUMNS:
                table.add_column(column, key=column)

    def tables(self) -> tuple[DataTable[Any], IncrementalDataTable]:
        return self.query_one("#plain", DataTable), self.query_one("#incremental", IncrementalDataTable)

    def both(self, method: str, *args: Any, **kwargs: Any) -> None:
        for table in self.tables():
            getattr(table, method)(*args, **kwargs)


def _row(i: int, score: int = 100) -> list[Any]:
    return [Text(f"vllm-{i}", style="bold"), Text("healthy", style="green"), Text(f"{score}"), Text("0")]


def _lines(table: DataTable[Any]) -> list[list[Any]]:
    """Every line the table draws now: text and style of each segment (styles carry the row meta).

    ``refresh()`` first: else the widget's own line cache answers for the lines it thinks clean,
    and the table's caches (what is under test) are never asked."""
    table.refresh()
    return [[(seg.text, seg.style) for seg in strip] for strip in table.render_lines(Region(0, 0, WIDTH, HEIGHT))]


def _reorder_plain(table: DataTable[Any], order: list[str]) -> None:
    position = {name: i for i, name in enumerate(order)}
    table.sort("name", key=lambda cell: position[str(cell)])


async def test_draws_what_a_datatable_draws_through_updates_reorders_and_clears() -> None:
    app = _Pair()
    rng = random.Random(7)
    async with app.run_test(size=(WIDTH, 2 * HEIGHT + 2)) as pilot:
        plain, incremental = app.tables()
        for i in range(8):
            app.both("add_row", *_row(i), key=f"vllm-{i}")
        await pilot.pause()
        assert _lines(incremental) == _lines(plain)
        names = [f"vllm-{i}" for i in range(8)]
        for step in range(40):
            action = rng.choice(("update", "update", "update", "reorder", "cursor"))
            if action == "update":
                name, column = rng.choice(names), rng.choice(COLUMNS[1:])
                value = Text(rng.choice(("healthy", "degraded", "ejected", "7", "12345", "-")))
                app.both("update_cell", name, column, value, update_width=True)
            elif action == "reorder":
                rng.shuffle(names)
                incremental.reorder(names)
                _reorder_plain(plain, names)
            else:
                app.both("move_cursor", row=rng.randrange(len(names)), animate=False)
            await pilot.pause()
            assert [c.content_width for c in incremental.columns.values()] == [c.content_width for c in plain.columns.values()], step
            assert _lines(incremental) == _lines(plain), (step, action)
        app.both("clear")
        for i in (3, 1):  # keys used before: their old renders must not come back
            app.both("add_row", *_row(i, score=5), key=f"vllm-{i}")
        await pilot.pause()
        assert _lines(incremental) == _lines(plain)


async def test_one_changed_cell_renders_one_cell(monkeypatch: pytest.MonkeyPatch) -> None:
    app = _Pair()
    async with app.run_test(size=(WIDTH, 2 * HEIGHT + 2)) as pilot:
        _, incremental = app.tables()
        for i in range(8):
            app.both("add_row", *_row(i), key=f"vllm-{i}")
        await pilot.pause()  # the resize that the new rows cause (a resize redraws everything) ...
        _lines(incremental)  # ... then one frame with every line drawn, whose cells are cached
        rendered: list[tuple[int, int]] = []
        parent = DataTable._render_cell

        def counting(self: DataTable[Any], row: int, column: int, *args: Any, **kwargs: Any) -> Any:
            if self is incremental:
                rendered.append((row, column))
            return parent(self, row, column, *args, **kwargs)

        monkeypatch.setattr(DataTable, "_render_cell", counting)
        incremental.update_cell("vllm-5", "score", Text("42"))
        lines = _lines(incremental)
        body = [(row, column) for row, column in rendered if row >= 0]  # the header is the parent's to draw
        assert body == [(5, COLUMNS.index("score"))]
        assert "42" in "".join(text for text, _ in lines[6])  # line 0 is the header


async def test_reorder_takes_every_row_once() -> None:
    app = _Pair()
    async with app.run_test(size=(WIDTH, 2 * HEIGHT + 2)) as pilot:
        _, incremental = app.tables()
        for i in range(3):
            incremental.add_row(*_row(i), key=f"vllm-{i}")
        await pilot.pause()
        incremental.move_cursor(row=1)
        incremental.reorder(["vllm-2", "vllm-0", "vllm-1"])
        assert [str(incremental.get_row_at(i)[0]) for i in range(3)] == ["vllm-2", "vllm-0", "vllm-1"]
        assert incremental.cursor_row == 1  # the position stays; the row under it is now vllm-0
        for bad in (["vllm-2", "vllm-0"], ["vllm-2", "vllm-0", "vllm-0"], ["vllm-2", "vllm-0", "vllm-9"]):
            with pytest.raises(ValueError, match="exactly the rows"):
                incremental.reorder(bad)


async def test_settle_widths_measures_at_once_what_idle_would_measure_later() -> None:
    app = _Pair()
    async with app.run_test(size=(WIDTH, 2 * HEIGHT + 2)) as pilot:
        plain, incremental = app.tables()
        for i in range(3):
            app.both("add_row", *_row(i), key=f"vllm-{i}")
        await pilot.pause()
        state = ColumnKey("state")
        assert incremental.columns[state].content_width == len("healthy")
        app.both("update_cell", "vllm-1", "state", Text("degraded (cooling)"), update_width=True)
        incremental.settle_widths()  # no await: nothing else has run
        assert incremental.columns[state].content_width == len("degraded (cooling)")
        await pilot.pause()
        assert plain.columns[state].content_width == incremental.columns[state].content_width

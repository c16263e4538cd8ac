"""A Textual ``DataTable`` that re-renders only the rows and cells whose value changed.

Textual's ``DataTable`` (8.2) keys every render cache (cell, row, line) on one
table-wide ``_update_count`` that each ``update_cell`` bumps: one changed cell
re-renders every visible cell through rich (at 64 backends x 15 columns, ~700
cells and most of ``llmdiag top``'s CPU on a tick where anything changed).

:class:`IncrementalDataTable` keeps its own cell and line caches, keyed on
what the output depends on, with a *stamp* per cell and per row instead of the
global count: ``update_cell`` and ``add_row`` stamp what they touched, so a
changed cell costs one rich render and its line one re-assembly. Anything else
that bumps ``_update_count`` (resize, sort, removing a row, adding a column, an
unknown future path) starts a new *generation*, which misses every entry:
exactly the parent's behaviour, never a stale screen. ``clear()``, style and
cursor-visibility changes clear the caches as the parent does. The header row
and row labels are left to the parent (one line, rarely drawn).

Two more costs of the parent that grow with the table: :meth:`reorder` puts
the same rows in a new order without ``clear()`` and re-adding them (a row
that keeps its place keeps its renders: the caches key on its position), and
column widths after ``update_cell(..., update_width=True)`` measure a whole
column at most once per batch, not once per narrower cell (64 cells of one
column changing together were 64 x 64 measurements), with the same result.

It relies on private parts of ``DataTable`` (the ``_render_cell`` and
``_render_line`` hooks, ``_update_count``); ``textual`` is pinned in the dev
extra and the TUI tests (Pilot, SVG snapshots, tmux) cover the output.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import count
from typing import Any

from rich.segment import Segment
from rich.style import Style
from textual._two_way_dict import TwoWayDict
from textual.cache import LRUCache
from textual.geometry import Region
from textual.render import measure
from textual.strip import Strip
from textual.widgets import DataTable
from textual.widgets._data_table import default_cell_formatter
from textual.widgets.data_table import CellKey, ColumnKey, RowKey

__all__ = ["IncrementalDataTable"]

#: Rendered cells kept (all visible cells with and without the cursor, several times over).
_CELL_CACHE = 10_000
#: Rendered lines kept (a tall terminal's worth, with the cursor on a few rows).
_LINE_CACHE = 2_000


class IncrementalDataTable(DataTable[Any]):
    """``DataTable`` whose redraw costs the changed cells, not the whole table (see the module doc)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stamps = count(1)
        self._cell_stamps: dict[tuple[RowKey, ColumnKey], int] = {}
        self._row_births: dict[RowKey, int] = {}  # stamp of add_row: a reused key never meets old renders
        self._row_stamps: dict[RowKey, int] = {}  # stamp of the row's latest change (its line)
        self._generation = 0
        self._seen_update_count = self._update_count
        self._layout_key: tuple[Any, ...] = ()
        self._stable_cells: LRUCache[tuple[Any, ...], list[list[Segment]]] = LRUCache(_CELL_CACHE)
        self._stable_lines: LRUCache[tuple[Any, ...], Strip] = LRUCache(_LINE_CACHE)

    # -- what changed ---------------------------------------------------------------
    def _sync_generation(self) -> None:
        """A bump of ``_update_count`` this class did not account for: invalidate everything."""
        if self._update_count != self._seen_update_count:
            self._generation += 1
            self._seen_update_count = self._update_count

    def update_cell(self, row_key: RowKey | str, column_key: ColumnKey | str, value: Any, *,
                    update_width: bool = False) -> None:
        self._sync_generation()
        super().update_cell(row_key, column_key, value, update_width=update_width)
        row = RowKey(row_key) if isinstance(row_key, str) else row_key
        column = ColumnKey(column_key) if isinstance(column_key, str) else column_key
        stamp = next(self._stamps)
        self._cell_stamps[(row, column)] = stamp
        self._row_stamps[row] = stamp
        self._seen_update_count = self._update_count
        if update_width:
            # The widths are measured on the table's next Idle event, and update_cell (unlike
            # add_row) does not ask for one: without this a column could stay narrow ("degra")
            # until something else happened to reach the table.
            self.check_idle()

    def add_row(self, *cells: Any, height: int | None = 1, key: str | None = None, label: Any = None) -> RowKey:
        self._sync_generation()
        row_key = super().add_row(*cells, height=height, key=key, label=label)
        self._row_births[row_key] = self._row_stamps[row_key] = next(self._stamps)
        self._seen_update_count = self._update_count
        return row_key

    def reorder(self, keys: Sequence[str]) -> None:
        """Put the rows in the order of ``keys``, which must name every row once (else ``ValueError``).

        Like :meth:`sort` (the cursor keeps its position, so it lands on whichever row is there now),
        but by key; renders of rows that keep their position stay cached."""
        order = [RowKey(k) for k in keys]
        if len(order) != len(self.rows) or set(order) != set(self.rows):
            raise ValueError("reorder: the keys must be exactly the rows of the table")
        self._sync_generation()
        # What sort() does, with the order given (the cell and line caches key on positions).
        self._row_locations = TwoWayDict({key: index for index, key in enumerate(order)})
        self._update_count += 1
        self._seen_update_count = self._update_count
        self.refresh()

    def settle_widths(self) -> None:
        """Measure now what ``update_cell(..., update_width=True)`` and ``add_row`` left for the
        table's next Idle event (the parent's ``_on_idle``): call it after a batch of updates, so the
        next frame never shows a column too narrow for its new value, however the events interleave."""
        if self._updated_cells:
            updated_cells = self._updated_cells.copy()
            self._updated_cells.clear()
            self._update_column_widths(updated_cells)
        if self._require_update_dimensions:
            self._require_update_dimensions = False
            new_rows = self._new_rows.copy()
            self._new_rows.clear()
            self._update_dimensions(new_rows)

    def _update_column_widths(self, updated_cells: Iterable[CellKey]) -> None:
        """The parent's width rule, cell by cell in the same order, but a column's widest cell is
        measured once per call: every cell has its final value by now, so that maximum cannot
        change between the cells of one batch."""
        console = self.app.console
        widest: dict[tuple[ColumnKey, int], int] = {}
        for row_key, column_key in updated_cells:
            column = self.columns.get(column_key)
            row = self.rows.get(row_key)
            if column is None or row is None:
                continue
            label_width = measure(console, column.label, 1)
            wrap, height = row.height != 1, row.height
            new_width = measure(console, default_cell_formatter(self._data[row_key][column_key], wrap=wrap,
                                                                height=height), 1)
            if new_width < column.content_width:
                if (column_key, height) not in widest:
                    widest[(column_key, height)] = max(
                        [*(measure(console, default_cell_formatter(cell, wrap=wrap, height=height), 1)
                           for cell in self.get_column(column_key)), label_width])
                column.content_width = widest[(column_key, height)]
            else:
                column.content_width = max(new_width, label_width)
        self._require_update_dimensions = True

    def _clear_caches(self) -> None:
        super()._clear_caches()
        self._stable_cells.clear()
        self._stable_lines.clear()
        # A new generation misses everything, so the stamps can start over (no growth across clear()).
        self._cell_stamps.clear()
        self._row_births.clear()
        self._row_stamps.clear()
        self._generation += 1

    def notify_style_update(self) -> None:
        self._stable_cells.clear()
        self._stable_lines.clear()
        self._generation += 1
        super().notify_style_update()

    # -- rendering --------------------------------------------------------------------
    def render_lines(self, crop: Region) -> list[Strip]:
        self._sync_generation()
        # Everything besides a row's own cells that shapes its line, read once per frame (the
        # compositor renders the table only through here; the parent sets _pseudo_class_state here too).
        self._layout_key = (
            self._generation, self.size.width, tuple(c.get_render_width(self) for c in self.ordered_columns),
            self._row_label_column_width, self.show_row_labels, self._labelled_row_exists, self.fixed_rows,
            self.fixed_columns, self.cell_padding, self.zebra_stripes, self.show_cursor,
            self.cursor_foreground_priority, self.cursor_background_priority,
        )
        return super().render_lines(crop)

    def _render_cell(self, row_index: int, column_index: int, base_style: Style, width: int,
                     cursor: bool = False, hover: bool = False) -> list[list[Segment]]:
        if row_index < 0 or column_index < 0:  # header and row labels: the parent's cache
            return super()._render_cell(row_index, column_index, base_style, width, cursor, hover)
        row_key = self._row_locations.get_key(row_index)
        column_key = self._column_locations.get_key(column_index)
        key = (row_key, column_key, self._row_births.get(row_key), self._cell_stamps.get((row_key, column_key)),
               row_index, column_index, width, base_style, cursor, hover, self._show_hover_cursor,
               self._pseudo_class_state, self._layout_key)
        lines = self._stable_cells.get(key)
        if lines is None:
            lines = super()._render_cell(row_index, column_index, base_style, width, cursor, hover)
            self._stable_cells[key] = lines
        return lines

    def _render_line(self, y: int, x1: int, x2: int, base_style: Style) -> Strip:
        try:
            row_key, _ = self._get_offsets(y)
        except LookupError:
            return super()._render_line(y, x1, x2, base_style)
        if row_key is self._header_row_key:
            return super()._render_line(y, x1, x2, base_style)
        key = (y, row_key, self._row_stamps.get(row_key), x1, x2, self.cursor_coordinate, self.hover_coordinate,
               base_style, self.cursor_type, self._show_hover_cursor, self._pseudo_class_state, self._layout_key)
        strip = self._stable_lines.get(key)
        if strip is None:
            strip = super()._render_line(y, x1, x2, base_style)
            self._stable_lines[key] = strip
        return strip

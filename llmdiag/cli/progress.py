"""Show each collector as it starts, on a terminal: a BPF compile takes seconds per program.

:class:`CollectorProgress` is the ``progress`` callback of
:func:`llmdiag.agent.wiring.build_collectors`. On a terminal (stderr) it
shows a spinner per collector while it builds, then ``ok`` or
``unavailable`` with the time it took; at the end one summary line stays.
Elsewhere (a pipe, a log file) it prints nothing.
"""

from __future__ import annotations

import time
from types import TracebackType

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.text import Text

from llmdiag.model import CollectorState, CollectorStatus

__all__ = ["CollectorProgress"]


class CollectorProgress:
    """A context manager; call the instance as ``progress(name, status)`` (see module doc)."""

    def __init__(self, console: Console | None = None, enabled: bool | None = None) -> None:
        self.console = console or Console(stderr=True, highlight=False)
        self.enabled = self.console.is_terminal if enabled is None else enabled
        self.took: dict[str, tuple[float, CollectorStatus]] = {}
        self._started: dict[str, float] = {}
        self._tasks: dict[str, TaskID] = {}
        self._progress = Progress(SpinnerColumn(finished_text=" "), TextColumn("{task.description}"),
                                  TimeElapsedColumn(), console=self.console, transient=True)

    def __enter__(self) -> CollectorProgress:
        if self.enabled:
            self._progress.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not self.enabled:
            return
        self._progress.stop()
        if exc_type is None and self.took:
            self.console.print(self.summary())

    def __call__(self, name: str, status: CollectorStatus | None) -> None:
        if status is None:
            self._started[name] = time.monotonic()
            if self.enabled:
                self._tasks[name] = self._progress.add_task(f"starting collector {name} (compiling BPF can take seconds)",
                                                            total=1)
            return
        self.took[name] = (time.monotonic() - self._started.pop(name, time.monotonic()), status)
        if self.enabled and name in self._tasks:
            self._progress.update(self._tasks[name], completed=1, description=f"{name}: {status.status.value}")

    def summary(self) -> Text:
        """``collectors started in 9.2 s: tcp 1.7 s, http2 6.5 s, proc; unavailable: gpu``."""
        total = sum(seconds for seconds, _ in self.took.values())
        running = [f"{n} {s:.1f} s" if s >= 0.1 else n for n, (s, st) in self.took.items()
                   if st.status is not CollectorState.UNAVAILABLE]
        missing = [n for n, (_, st) in self.took.items() if st.status is CollectorState.UNAVAILABLE]
        text = Text(f"collectors started in {total:.1f} s: {', '.join(running) or 'none'}", style="dim")
        if missing:
            text.append(f"; unavailable: {', '.join(missing)}", style="yellow")
        return text


"""Stop a live run at Ctrl-C and still report what was seen, as bcc's tools do.

While :class:`StopRequest` is active, the first SIGINT or SIGTERM only asks
the run to stop: :meth:`StopRequest.until_stopped` ends the snapshot stream
after the snapshot in progress (at most one ``[agent] interval_seconds``
later), the collectors are closed as at a normal end, and the command
prints its report. A second signal interrupts at once (KeyboardInterrupt,
exit 130, no report).
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable, Iterator
from types import FrameType, TracebackType
from typing import Any, TypeVar

__all__ = ["StopRequest"]

T = TypeVar("T")


class StopRequest:
    """A context manager that turns the first SIGINT/SIGTERM into a request to stop."""

    def __init__(self, notice: Callable[[str], None] | None = None) -> None:
        self.signal: int | None = None
        self.at: float | None = None  # time.monotonic() of the request
        self._notice = notice or (lambda text: print(text, file=sys.stderr, flush=True))
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal is not None:
            raise KeyboardInterrupt  # the second one: stop now
        self.signal, self.at = signum, time.monotonic()
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        self._notice(f"llmdiag: {name}: stopping after this snapshot to report what was seen "
                     "(again to quit at once)")

    def __enter__(self) -> StopRequest:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def until_stopped(self, items: Iterator[T]) -> Iterator[T]:
        """Yield from ``items`` until a stop is requested; then close ``items`` (its ``finally``
        runs: BPF programs detached) and end, so the consumer finishes normally."""
        try:
            while not self.requested:
                try:
                    item = next(items)
                except StopIteration:
                    return
                yield item
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()

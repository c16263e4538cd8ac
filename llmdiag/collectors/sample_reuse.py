"""Samples of a subject whose signals repeat, built once: :class:`SampleReuse`.

Samples are frozen, and building one is not free (a frozen dataclass with a check);
a collector that reads dozens of idle subjects a tick (endpoints without traffic, an
engine process that did nothing, a destination whose TIME_WAIT count repeats) built
hundreds of identical ones every tick. A subject's samples are reused when its signal
names, values and value types, in order, are what they were last tick. Labelled
values are mutable dicts that consumers own, so signals holding one are always built
anew.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any

from llmdiag.model import Sample

__all__ = ["SampleReuse"]


class SampleReuse:
    """Per collector: call :meth:`samples` for each subject of a tick, then :meth:`next_tick`."""

    __slots__ = ("_last", "_now")

    def __init__(self) -> None:
        self._last: dict[Hashable, tuple[tuple[Any, ...], list[Sample]]] = {}
        self._now: dict[Hashable, tuple[tuple[Any, ...], list[Sample]]] = {}

    def samples(self, key: Hashable, signals: Mapping[str, Any], build: Callable[[], list[Sample]]) -> list[Sample]:
        """``build()``, or last tick's list for ``key`` when ``signals`` (and anything else
        ``key`` stands for: give every input of ``build`` in it) are the same."""
        values = tuple(signals.values())
        if any(isinstance(v, dict) for v in values):
            return build()  # a Labelled value: the consumer gets its own each tick
        fingerprint = (tuple(signals), values, tuple(map(type, values)))
        last = self._last.get(key)
        made = last[1] if last is not None and last[0] == fingerprint else build()
        self._now[key] = (fingerprint, made)
        return made

    def next_tick(self) -> None:
        """End of a tick: subjects not seen in it are forgotten."""
        self._last, self._now = self._now, {}

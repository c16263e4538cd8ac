"""Samples of a subject whose signals repeat, built once: :class:`SampleReuse`.

Samples are immutable, and building one is not free (a slots class with a check);
a collector that reads dozens of idle subjects a tick (endpoints without traffic, an
engine process that did nothing, a destination whose TIME_WAIT count repeats) built
hundreds of identical ones every tick. With :meth:`SampleReuse.each`, each
signal whose value and value type are what they were last tick keeps last tick's Sample
(a busy subject, an engine process whose CPU time moves every tick, still repeats most of
its signals); only the ones that moved are built. Labelled values are mutable dicts that
consumers own, so signals holding one are always built anew.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from llmdiag.model import Sample, Scope

__all__ = ["SampleReuse"]


class SampleReuse:
    """Per collector: call :meth:`each` for the subjects of a tick, then :meth:`next_tick`."""

    __slots__ = ("_labelled", "_last_each", "_now_each")

    def __init__(self) -> None:
        # (scope, subject) -> (names, values, types, Samples) of the last tick, for each().
        self._last_each: dict[Hashable, tuple[tuple[str, ...], tuple[Any, ...], tuple[type, ...], list[Sample]]] = {}
        self._now_each: dict[Hashable, tuple[tuple[str, ...], tuple[Any, ...], tuple[type, ...], list[Sample]]] = {}
        self._labelled: dict[tuple[type, ...], tuple[bool, ...]] = {}  # value types -> which are dicts

    def each(self, subjects: Sequence[tuple[Scope, str]], signals: Mapping[str, Any]) -> list[Sample]:
        """``[Sample(scope, subject, name, value) for scope, subject in subjects for name, value in
        signals.items()]``, where each Sample whose subject, name, value and value type are what
        they were last tick is last tick's object. A Labelled (dict) value is always built anew."""
        names = tuple(signals)
        values = tuple(signals.values())
        types = tuple(map(type, values))
        labelled = self._labelled.get(types)
        if labelled is None:
            if len(self._labelled) > 1024:
                self._labelled.clear()  # bounded: the shapes a collector emits are few
            labelled = self._labelled[types] = tuple(issubclass(t, dict) for t in types)
        out: list[Sample] = []
        for scope, subject in subjects:
            key = (scope, subject)
            last = self._last_each.get(key)
            if last is not None and last[0] == names and last[2] == types and last[1] == values and True not in labelled:
                made = last[3]  # the whole subject repeats (tuples compare in C)
            elif last is not None and last[0] == names:
                # Same signals, some values moved: keep the Samples of the ones that did not.
                old_values, old_types, old = last[1], last[2], last[3]
                made = [
                    old[i] if (types[i] is old_types[i] and not labelled[i] and old_values[i] == value)
                    else Sample(scope, subject, name, value)
                    for i, (name, value) in enumerate(zip(names, values))
                ]
            else:
                made = [Sample(scope, subject, name, value) for name, value in zip(names, values)]
            self._now_each[key] = (names, values, types, made)
            out.extend(made)
        return out

    def next_tick(self) -> None:
        """End of a tick: subjects not seen in it are forgotten."""
        self._last_each, self._now_each = self._now_each, {}

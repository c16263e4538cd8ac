"""The collector contract (SPEC section 4) and the guard that runs collectors.

A collector is an object whose roots (``proc_root``, ``sys_root``, an NVML
handle, an HTTP session, a clock) are constructor arguments and whose one job
is :meth:`Collector.collect`::

    class Collector(Protocol):
        name: str                       # "engine", "tcp", "timewait", "gpu", ...
        def collect(self, now: float) -> list[Sample]: ...
        def status(self) -> CollectorStatus: ...
        def close(self) -> None: ...    # detach BPF, stop threads; idempotent

``collect`` returns samples and never prints. Expensive set-up (compiling BPF)
happens in ``start()`` or the constructor, once, not per tick.

:class:`GuardedCollector` wraps any collector so that an exception in one
collector never stops the others: it is caught, counted, turned into a
``degraded`` status with the reason, and logged at warning once per distinct
cause (not once per tick).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from llmdiag.bpf import features
from llmdiag.model import CollectorState, CollectorStatus, Sample, Snapshot

__all__ = ["AttachNeed", "Collector", "CollectorUsageError", "GuardedCollector", "collect_snapshot"]

log = logging.getLogger("llmdiag.collectors")


@dataclass(frozen=True, slots=True)
class AttachNeed:
    """A kernel attach point a collector uses, as the collector itself declares it (what
    ``llmdiag doctor`` checks). ``kind``: ``tracepoint`` (target ``category:event``),
    ``raw_tracepoint``, ``kprobe`` (a kernel function) or ``uprobe`` (``library:symbol``).
    ``required``: the collector cannot run without it; otherwise one signal, or one faster
    path, is missing (``purpose`` says which)."""

    collector: str
    kind: str
    target: str
    purpose: str
    required: bool = False

    def describe(self) -> str:
        return f"{self.kind}:{self.target}"

    def present(self) -> bool | None:
        """Whether this kernel offers it; ``None`` where that cannot be told here (a raw
        tracepoint needs bcc to probe; a uprobe's symbol depends on the process's library,
        so only uprobe support itself is checked)."""
        if self.kind == "tracepoint":
            category, _, event = self.target.partition(":")
            return features.tracepoint_exists(category, event)
        if self.kind == "kprobe":
            return bool(features.kprobes_supported())
        if self.kind == "uprobe":
            return bool(features.uprobes_supported())
        return None


class CollectorUsageError(ValueError):
    """The user asked a collector for something that cannot work (a missing or unreadable
    input file, such as ``--nvml-replay FILE``): a usage mistake, not a host without the
    feature. Callers that build collectors let it through (the command exits 64 with the
    message, which names the file) instead of reporting the collector as unavailable."""


@runtime_checkable
class Collector(Protocol):
    name: str

    def collect(self, now: float) -> list[Sample]: ...

    def status(self) -> CollectorStatus: ...

    def close(self) -> None: ...


class GuardedCollector:
    """Runs a collector so that its failures degrade it instead of the agent."""

    def __init__(self, inner: Collector) -> None:
        self.inner = inner
        self.name = inner.name
        self.errors_total = 0
        self._last_error: str | None = None
        self._logged_causes: set[str] = set()
        self._last_ok_ts: float | None = None

    def collect(self, now: float) -> list[Sample]:
        try:
            samples = list(self.inner.collect(now))
        except Exception as exc:  # noqa: BLE001 - the whole point is to contain it
            self.errors_total += 1
            cause = f"{type(exc).__name__}: {exc}"
            self._last_error = cause
            if cause not in self._logged_causes:
                self._logged_causes.add(cause)
                log.warning("collector %s failed: %s", self.name, cause, exc_info=log.isEnabledFor(logging.DEBUG))
            return []
        self._last_error = None
        self._last_ok_ts = now
        return samples

    def status(self) -> CollectorStatus:
        try:
            inner = self.inner.status()
        except Exception as exc:  # noqa: BLE001
            inner = CollectorStatus(CollectorState.DEGRADED, f"status() failed: {exc}")
        if self._last_error is not None:
            return CollectorStatus(
                CollectorState.DEGRADED, f"collect() raised {self._last_error}", self._last_ok_ts, self.errors_total
            )
        # collect() returning without an exception is "ok" only if the collector itself says so:
        # an unavailable collector returns [] every tick and has no last good tick.
        last_ok = inner.last_ok_ts or (self._last_ok_ts if inner.status is CollectorState.OK else None)
        return CollectorStatus(inner.status, inner.reason, last_ok, self.errors_total + inner.errors_total)

    def close(self) -> None:
        try:
            self.inner.close()
        except Exception as exc:  # noqa: BLE001
            log.warning("collector %s failed to close cleanly: %s", self.name, exc)


def collect_snapshot(
    collectors: Iterable[GuardedCollector], now: float, hostname: str = ""
) -> Snapshot:
    """Run every collector once and fold the samples into one snapshot."""
    snap = Snapshot(ts=now, hostname=hostname)
    for collector in collectors:
        snap.extend(collector.collect(now))
        snap.collectors[collector.name] = collector.status()
    return snap

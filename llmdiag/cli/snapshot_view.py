"""The human view of a snapshot for ``llmdiag collect`` without ``--json``.

One block per tick: the collectors' statuses, a line of host signals, then per
backend its signals grouped by where they come from (engine, latency, TCP,
HTTP/2, process, GPU) and per GPU its signals, every value with its unit.
Units follow the signal naming of SPEC 3.2 (base units: ``_seconds``,
``_bytes``, ratios 0..1; counters end in ``_total``), so a new signal gets a
unit without a change here. Per-destination signals and DP-engine breakdowns
stay in ``--json``; this view says how many there are.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping

from rich.console import Console, ConsoleOptions, Group, RenderableType
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from llmdiag.model import CollectorState, Distribution, Snapshot

__all__ = ["format_value", "print_snapshot", "render_snapshot"]

_STATUS_STYLE = {CollectorState.OK: "green", CollectorState.DEGRADED: "yellow", CollectorState.UNAVAILABLE: "red"}

#: Groups of a backend's signals, in display order: (label, does this signal belong here).
_GROUPS: tuple[tuple[str, Callable[[str], bool]], ...] = (
    ("engine", lambda n: n.startswith(("requests_", "kv_", "preemptions", "prompt_tokens", "generation_tokens",
                                       "responses_", "up", "scrape_", "counter_resets", "num_", "spec_"))),
    ("latency", lambda n: n.endswith("_seconds") and n.split("_")[0] in {"ttft", "itl", "tpot", "e2e", "queue",
                                                                          "prefill", "decode", "inference"}),
    ("tcp", lambda n: n.startswith(("tcp_", "timewait_", "srtt_", "ephemeral_", "port_exhaustion", "sockstat_",
                                    "conntrack_"))),
    ("pressure", lambda n: n.startswith("psi_")),
    ("http2", lambda n: n.startswith(("h2_", "http2_", "rst_stream", "goaway", "grpc_"))),
    ("gpu", lambda n: n.startswith(("gpu_", "cuda_", "nvml_", "xid", "pcie_"))),
    ("process", lambda n: n.startswith(("rss_", "swap_", "mapped_", "cpu_", "io_", "open_fds", "threads_",
                                        "major_faults", "minor_faults", "ctx_switches"))),
)
_RATIO_SUFFIXES = ("_usage", "_utilization", "_ratio", "_fraction")


def _number(value: float) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if float(value).is_integer() and abs(value) < 1e15:
        return f"{int(value):,}"
    return f"{value:.3g}"


def _duration(seconds: float) -> str:
    magnitude = abs(seconds)
    if magnitude == 0:
        return "0 s"
    if magnitude < 1e-3:
        return f"{seconds * 1e6:.3g} µs"
    if magnitude < 1:
        return f"{seconds * 1e3:.3g} ms"
    if magnitude < 120:
        return f"{seconds:.3g} s"
    if magnitude < 7200:
        return f"{seconds / 60:.3g} min"
    return f"{seconds / 3600:.3g} h"


def _size(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.3g} {unit}"
        count /= 1024
    return f"{count:.3g} TiB"  # pragma: no cover - the loop returns


def _with_unit(name: str, value: float) -> str:
    if not math.isfinite(value):
        return "n/a"
    base = name.removesuffix("_total")
    if base.endswith("_seconds"):
        return _duration(value)
    if base.endswith(("_bytes", "_rchar", "_wchar")):  # rchar/wchar: bytes through read()/write()
        return _size(value)
    if name.endswith(_RATIO_SUFFIXES) or (name.startswith("psi_") and "_avg" in name):
        return f"{value * 100:.3g} %"
    if name.endswith(("_rate", "_per_second")):
        return f"{value:.3g}/s"
    if name.endswith("_celsius"):
        return f"{value:.0f} °C"
    if name.endswith("_watts"):
        return f"{value:.3g} W"
    if name.endswith("_hertz"):
        return f"{value / 1e6:.4g} MHz"
    return _number(value)


def format_value(name: str, value: object) -> str:
    """One signal value as a person reads it: ``"42 %"``, ``"p50 120 ms  p99 1.2 s (n=88)"``."""
    if value is None:
        return "n/a"
    if isinstance(value, Distribution):
        if value.count == 0 or (value.p50 is None and value.p99 is None):
            return "no samples"
        parts = [f"{k} {_with_unit(name, v) if v is not None else 'n/a'}" for k, v in (("p50", value.p50), ("p99", value.p99))]
        count = f" (n={_number(value.count)})" if value.count is not None else ""
        return "  ".join(parts) + count
    if isinstance(value, Mapping):
        if not value:
            return "-"
        return ", ".join(f"{key.split('=', 1)[-1]} {_with_unit(name, v)}" for key, v in sorted(value.items()))
    if isinstance(value, (int, float)):
        return _with_unit(name, float(value)) if not isinstance(value, bool) else str(value).lower()
    return str(value)


class _Items:
    """``name value`` items joined by `` · ``, packed into lines at render time so that a line
    breaks only between items, never between a number and its unit (rich wraps at any space)."""

    def __init__(self, signals: Mapping[str, object], names: Iterable[str]) -> None:
        self.items = [(name, format_value(name, signals[name])) for name in names]

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterator[Text]:
        width = options.max_width
        line, used = Text(), 0
        for name, value in self.items:
            size = len(name) + 1 + len(value)
            if used and used + 3 + size > width:
                yield line
                line, used = Text(), 0
            if used:
                line.append(" · ", style="dim")
                used += 3
            line.append(f"{name} ", style="dim")
            line.append(value)
            used += size
        if used:
            yield line


def _grouped(signals: Mapping[str, object]) -> list[tuple[str, list[str]]]:
    groups: dict[str, list[str]] = {label: [] for label, _ in _GROUPS}
    groups["other"] = []
    for name in sorted(signals):
        label = next((label for label, belongs in _GROUPS if belongs(name)), "other")
        groups[label].append(name)
    return [(label, names) for label, names in groups.items() if names]


def _block(title: Text, signals: Mapping[str, object]) -> RenderableType:
    grid = Table.grid(padding=(0, 1))
    grid.add_column(style="bold", no_wrap=True, width=8)
    grid.add_column(overflow="fold")
    for label, names in _grouped(signals):
        grid.add_row(label, _Items(signals, names))
    return Group(title, Padding(grid, (0, 0, 0, 2)))


def render_snapshot(snap: Snapshot) -> RenderableType:
    """The view of one snapshot (see the module docstring)."""
    parts: list[RenderableType] = []
    head = Text()
    head.append(time.strftime("%H:%M:%S", time.localtime(snap.ts)), style="bold")
    head.append(f" on {snap.hostname or '?'}  ")
    for i, (name, status) in enumerate(sorted(snap.collectors.items())):
        if i:
            head.append(" · ", style="dim")
        head.append(f"{name} ")
        head.append(status.status.value, style=_STATUS_STYLE[status.status])
    parts.append(head)
    troubles = [(n, s.reason) for n, s in sorted(snap.collectors.items()) if s.status is not CollectorState.OK and s.reason]
    for name, reason in troubles:  # Text: reasons carry brackets ("[[backends]]") that markup would eat
        parts.append(Padding(Text(f"{name}: {reason}", style="dim"), (0, 0, 0, 2)))
    if snap.host:
        host_title = Text("host", style="bold underline")
        if snap.destinations:
            host_title.append(f"  ({len(snap.destinations)} destinations: see --json)", style="dim")
        parts.append(_block(host_title, snap.host))
    for name, signals in sorted(snap.backends.items()):
        title = Text(name, style="bold underline")
        engines = snap.engines.get(name, {})
        if len(engines) > 1:
            title.append(f"  ({len(engines)} DP engines: see --json)", style="dim")
        parts.append(_block(title, signals))
    for index, signals in sorted(snap.gpus.items(), key=lambda kv: (len(kv[0]), kv[0])):
        parts.append(_block(Text(f"gpu {index}", style="bold underline"), signals))
    if not (snap.host or snap.backends or snap.gpus):
        parts.append(Text("no signals in this snapshot", style="yellow"))
    return Group(*parts)


def print_snapshot(snap: Snapshot, console: Console | None = None) -> None:
    console = console or Console(highlight=False)
    console.print(render_snapshot(snap))
    console.print()

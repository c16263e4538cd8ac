"""The rich report of ``llmdiag diagnose``: diagnoses grouped by backend, with evidence tables.

:func:`diagnosis_renderable` draws one diagnosis (headline, summary, evidence
table, remediation); the report and the TUI's backend view both use it, so a
diagnosis reads the same in both."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import TYPE_CHECKING

from rich import box
from rich.console import Console, Group
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from llmdiag.model import HOST, CollectorState, Diagnosis, Severity

if TYPE_CHECKING:
    from llmdiag.agent.loop import DiagnoseReport, Episode

__all__ = ["diagnosis_renderable", "print_report", "render_report", "report_json", "verdict"]

_SEVERITY_STYLE = {Severity.CRITICAL: "bold red", Severity.WARNING: "yellow", Severity.INFO: "cyan"}
_STATUS_STYLE = {CollectorState.OK: "green", CollectorState.DEGRADED: "yellow", CollectorState.UNAVAILABLE: "red"}


def _utc(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def _fmt(value: object) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _episode(e: Episode) -> Group:
    return diagnosis_renderable(e.diagnosis, closed_at=e.closed_at, enforced=e.enforced)


def diagnosis_renderable(d: Diagnosis, *, closed_at: float | None = None, enforced: bool = True) -> Group:
    """One diagnosis: severity and kind, since/state/confidence/penalty, summary, evidence, remediation."""
    head = Text()
    head.append(f"{d.severity.value.upper():8} ", style=_SEVERITY_STYLE[d.severity])
    head.append(d.kind, style="bold")
    state = "open" if closed_at is None else f"closed {_utc(closed_at)}"
    head.append(f"  since {_utc(d.since)} ({state})  confidence {d.confidence:.2f}  penalty {d.penalty:.2f}")
    if not enforced:
        head.append("  (not enforced)", style="dim")
    evidence = Table(box=box.SIMPLE, show_edge=False, pad_edge=False)
    evidence.add_column("signal")
    evidence.add_column("value", justify="right")
    evidence.add_column("threshold", justify="right")
    evidence.add_column("window", justify="right")
    for item in d.evidence:
        evidence.add_row(Text(item.signal), _fmt(item.value), _fmt(item.threshold), item.window_text)
    return Group(head, Padding(Text(d.summary), (0, 0, 0, 2)), Padding(evidence, (0, 0, 0, 2)), Padding(Text(f"-> {d.remediation}", style="italic"), (0, 0, 1, 2)))


def verdict(report: DiagnoseReport) -> str:
    """``healthy`` (nothing above info), ``warning`` or ``critical``."""
    worst = report.worst
    return "healthy" if worst in (None, Severity.INFO) else worst.value  # type: ignore[union-attr]


def report_json(report: DiagnoseReport, interrupted: bool = False) -> dict[str, object]:
    """``diagnose --json``: the report's diagnoses and backends, plus what a reader needs to trust
    them: the verdict, the collectors' last statuses, the time range and the snapshot count."""
    return {
        "verdict": verdict(report),
        **report.to_json(),
        "collectors": {name: st.to_json() for name, st in sorted(report.collectors.items())},
        "first_ts": report.first_ts,
        "last_ts": report.last_ts,
        "snapshots": report.snapshots,
        "source": report.source,
        "interrupted": interrupted,
    }


def render_report(report: DiagnoseReport, console: Console) -> None:
    span = ""
    if report.first_ts is not None and report.last_ts is not None:
        span = f" from {_utc(report.first_ts)} to {_utc(report.last_ts)}"
    console.print(Text(f"llmdiag diagnose: {report.snapshots} snapshots{span} ({report.source})", style="bold"))
    console.print()
    collectors = Table(title="Collectors", title_justify="left", box=box.SIMPLE, show_edge=False)
    collectors.add_column("collector")
    collectors.add_column("status")
    collectors.add_column("reason")
    for name, st in sorted(report.collectors.items()):
        # Text, not a markup string: a reason such as "a [[backends]] grpc url" must print as written.
        collectors.add_row(name, Text(st.status.value, style=_STATUS_STYLE[st.status]), Text(st.reason or ""))
    if not report.collectors:
        collectors.add_row("(none)", Text("unavailable", style="red"), "no collector produced a snapshot")
    console.print(collectors)
    by_subject: dict[str, list[Episode]] = {}
    for e in report.episodes:
        by_subject.setdefault(e.diagnosis.backend, []).append(e)
    subjects = sorted(set(report.backends) | set(by_subject), key=lambda s: (s == HOST, s))
    if not subjects:
        console.print(Text("no backends seen and no host diagnoses", style="green"))
    for subject in subjects:
        title = Text()
        title.append(subject, style="bold underline")
        health = report.backends.get(subject)
        if health is not None:
            title.append(f"  {health.state.value}  penalty {health.penalty:.2f} (at end of run)")
        console.print(title)
        episodes = by_subject.get(subject, [])
        if not episodes:
            console.print(Padding(Text("no diagnoses", style="green"), (0, 0, 1, 2)))
        for e in episodes:
            console.print(Padding(_episode(e), (0, 0, 0, 2)))
    worst = report.worst
    said = verdict(report)
    style = "green" if said == "healthy" else _SEVERITY_STYLE[worst]  # type: ignore[index]
    n = len(report.episodes)
    console.print(Text(f"verdict: {said} ({n} {'diagnosis' if n == 1 else 'diagnoses'})", style=style))


def print_report(report: DiagnoseReport, width: int | None = None) -> None:
    render_report(report, Console(width=width, highlight=False))

"""Each collector is shown as it starts (a BPF compile takes seconds): the build hook and its display."""

from __future__ import annotations

import pytest
from rich.console import Console

from llmdiag.agent import wiring
from llmdiag.cli.progress import CollectorProgress
from llmdiag.config import Config
from llmdiag.model import CollectorState, CollectorStatus


def test_build_collectors_reports_each_collector_before_and_after(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(config, backends):
        raise OSError("no such device")

    monkeypatch.setitem(wiring.COLLECTOR_FACTORIES, "broken", broken)
    calls: list[tuple[str, str | None]] = []
    running, unavailable = wiring.build_collectors(
        Config(), [], ["proc", "broken"], progress=lambda name, status: calls.append((name, status and status.status.value)))
    try:
        assert calls == [("proc", None), ("proc", "ok"), ("broken", None), ("broken", "unavailable")]
        assert [c.name for c in running] == ["proc"] and set(unavailable) == {"broken"}
    finally:
        for collector in running:
            collector.close()


def test_the_display_ends_with_a_summary_on_a_terminal() -> None:
    console = Console(record=True, force_terminal=True, width=80)
    with CollectorProgress(console) as progress:
        progress("tcp", None)
        progress("tcp", CollectorStatus(CollectorState.OK))
        progress("gpu", None)
        progress("gpu", CollectorStatus(CollectorState.UNAVAILABLE, "no driver"))
    text = console.export_text()
    assert "collectors started in" in text and "tcp" in text and "unavailable: gpu" in text
    assert set(progress.took) == {"tcp", "gpu"}


def test_nothing_is_printed_off_a_terminal() -> None:
    console = Console(record=True, force_terminal=False, width=80)
    with CollectorProgress(console) as progress:
        progress("proc", None)
        progress("proc", CollectorStatus(CollectorState.OK))
    assert console.export_text() == ""

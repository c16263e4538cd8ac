"""Ctrl-C (or SIGTERM) during ``diagnose --duration`` reports what was seen, then exits 130;
``diagnose --json`` carries the verdict, the collectors, the time range and the snapshot count."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from llmdiag.cli.interrupt import StopRequest
from llmdiag.cli.main import main

PROC_FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "proc" / "host618"


def _config(tmp_path: Path) -> str:
    path = tmp_path / "fast.toml"
    path.write_text(f'[agent]\ninterval_seconds = 0.05\ncollectors = ["proc"]\ndiscover = false\n\n'
                    f'[proc]\nproc_root = "{PROC_FIXTURE}"\n')
    return str(path)


def _signal_once_watching(sig: signal.Signals) -> threading.Thread:
    """Send ``sig`` to this process once the watch has begun (the StopRequest handlers are in)."""

    def watching() -> bool:
        handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
        return all(isinstance(getattr(h, "__self__", None), StopRequest) for h in handlers)

    def run() -> None:
        deadline = time.monotonic() + 30
        while not watching() and time.monotonic() < deadline:
            time.sleep(0.005)
        if watching():
            os.kill(os.getpid(), sig)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_a_live_run_reports_what_was_seen(sig: signal.Signals, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    sender = _signal_once_watching(sig)
    code = main(["diagnose", "--config", _config(tmp_path), "--duration", "600", "--json"])
    sender.join(timeout=30)
    captured = capsys.readouterr()
    assert code == 130, captured.err
    doc = json.loads(captured.out)
    assert doc["interrupted"] is True and doc["verdict"] == "healthy"
    assert 1 <= doc["snapshots"] < 600 / 0.05
    assert doc["first_ts"] <= doc["last_ts"]
    assert doc["collectors"]["proc"]["status"] == "ok"
    stopped_by = "Ctrl-C" if sig == signal.SIGINT else "SIGTERM"
    assert f"stopped by {stopped_by} after" in doc["source"] and "of 600s" in doc["source"]
    assert "stopping after this snapshot" in captured.err and "Traceback" not in captured.err


def test_the_text_report_is_printed_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sender = _signal_once_watching(signal.SIGINT)
    assert main(["diagnose", "--config", _config(tmp_path), "--duration", "600"]) == 130
    sender.join(timeout=30)
    out = capsys.readouterr().out
    assert "stopped by Ctrl-C after" in out and "verdict: healthy" in out


def test_json_of_a_full_run_has_verdict_collectors_range_and_count(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diagnose", "--config", _config(tmp_path), "--duration", "0.2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) >= {"verdict", "diagnoses", "backends", "collectors", "first_ts", "last_ts", "snapshots",
                        "source", "interrupted"}
    assert doc["verdict"] == "healthy" and doc["interrupted"] is False and doc["snapshots"] == 4
    assert doc["first_ts"] < doc["last_ts"]


def test_a_second_signal_quits_at_once() -> None:
    stop = StopRequest(notice=lambda text: None)
    with stop:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)  # the handler runs between bytecodes
        assert stop.requested
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)


def test_until_stopped_closes_the_source() -> None:
    closed = []

    def source():
        try:
            yield from range(100)
        finally:
            closed.append(True)

    stop = StopRequest(notice=lambda text: None)
    seen = []
    for item in stop.until_stopped(source()):
        seen.append(item)
        if item == 2:
            stop.signal = signal.SIGINT
    assert seen == [0, 1, 2] and closed == [True]

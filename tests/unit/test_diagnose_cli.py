"""``llmdiag diagnose``: replay equals live, JSON shape, exit codes, the golden rich report."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
from rich.console import Console

from llmdiag.analyzers import Analyzer
from llmdiag.analyzers.timelines import SCENARIOS
from llmdiag.agent import wiring
from llmdiag.cli import diagnose
from llmdiag.cli.main import main
from llmdiag.cli.report import render_report
from llmdiag.config import Config
from llmdiag.model import CollectorState, CollectorStatus, Sample, Snapshot, write_snapshots

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


class RecordedCollector:
    """A real collector over recorded snapshots: each collect() returns the next tick's samples."""

    name = "recorded"

    def __init__(self, snapshots: list[Snapshot]) -> None:
        self._snapshots = list(snapshots)
        self.closed = False

    def collect(self, now: float) -> list[Sample]:
        return list(self._snapshots.pop(0).samples()) if self._snapshots else []

    def status(self) -> CollectorStatus:
        return CollectorStatus(CollectorState.OK)

    def close(self) -> None:
        self.closed = True


class FakeClock:
    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _episodes(report: diagnose.DiagnoseReport) -> list[dict]:
    return [e.to_json() for e in report.episodes]


@pytest.mark.parametrize("name", ["queue_avalanche", "client_timeout_storm", "gpu_fault", "scrape_gap", "counter_reset"])
def test_replay_of_a_recording_equals_the_live_run(name: str, tmp_path: Path, monkeypatch) -> None:
    snapshots = SCENARIOS[name].build().snapshots
    # Live: the same snapshots through a real collector, one per tick of an injected clock.
    # (scrape_gap has a 4 s hole in its ticks: the live clock cannot reproduce an agent pause,
    # so the live run is compared against a recording of exactly what it collected.)
    collector = RecordedCollector(snapshots)
    monkeypatch.setitem(wiring.COLLECTOR_FACTORIES, "recorded", lambda config, backends: collector)
    config = Config.from_toml('[agent]\ninterval_seconds = 1.0\nhostname = "sim-node"\ncollectors = ["recorded"]\n')
    clock = FakeClock(snapshots[0].ts)
    live = list(diagnose.live_snapshots(config, duration=len(snapshots), clock=clock, sleep=clock.sleep, backends=[]))
    assert collector.closed
    live_report = diagnose.analyze(iter(live), Analyzer(config))
    path = tmp_path / "rec.jsonl.gz"
    write_snapshots(path, live)
    replay_report = diagnose.analyze(diagnose.read_snapshots(path), Analyzer(config))
    assert _episodes(live_report) == _episodes(replay_report)
    assert live_report.to_json() == replay_report.to_json()
    # And the in-memory timeline (no collector) gives the same diagnoses where the ticks are the same.
    if name != "scrape_gap":
        direct = diagnose.analyze(iter(snapshots), Analyzer(config))
        assert _episodes(direct) == _episodes(replay_report)
    expect = SCENARIOS[name].expect
    assert {e["kind"] for e in _episodes(replay_report)} >= set(expect)


def test_cli_replay_json_and_exit_codes(tmp_path: Path, capsys) -> None:
    cases = {"queue_avalanche": 2, "connection_churn": 1, "healthy": 0, "kv_packed_no_queue": 0}
    for name, code in cases.items():
        path = tmp_path / f"{name}.jsonl"
        write_snapshots(path, SCENARIOS[name].build().snapshots)
        rc = main(["diagnose", "--replay", str(path), "--json"])
        out = json.loads(capsys.readouterr().out)
        assert rc == code, name
        assert set(out) == {"verdict", "diagnoses", "backends", "collectors", "first_ts", "last_ts", "snapshots",
                            "source", "interrupted"}
        assert out["verdict"] == {0: "healthy", 1: "warning", 2: "critical"}[code], name
        assert out["snapshots"] == len(SCENARIOS[name].build().snapshots) and out["interrupted"] is False
        assert out["first_ts"] <= out["last_ts"]
        assert set(out["backends"]) == {"vllm-0", "vllm-1"}
        assert all(set(v) == {"penalty", "state"} for v in out["backends"].values())
        for d in out["diagnoses"]:
            assert {"kind", "backend", "severity", "confidence", "since", "summary", "evidence", "remediation", "penalty"} <= set(d)


def test_cli_replay_of_a_broken_file_is_a_clear_error(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"schema": "llmdiag.snapshot/v1", "ts": 1}\nnot json\n')
    assert main(["diagnose", "--replay", str(bad)]) == 3
    assert "bad.jsonl:2" in capsys.readouterr().err
    assert main(["diagnose", "--replay", str(tmp_path / "missing.jsonl")]) == 3


def test_live_with_unavailable_and_broken_collectors(monkeypatch, capsys) -> None:
    def unavailable(config, backends):
        raise wiring.CollectorUnavailable("needs root for BPF; run as root or grant CAP_BPF")

    def broken(config, backends):
        raise RuntimeError("boom")

    monkeypatch.setattr(wiring, "COLLECTOR_FACTORIES", {"tcp": unavailable, "gpu": broken})
    monkeypatch.setattr(wiring, "resolve_backends", lambda config: [])
    config = Config.from_toml("[agent]\ninterval_seconds = 0.01\n")
    report = diagnose.analyze(diagnose.live_snapshots(config, duration=0.03), Analyzer(config))
    assert report.snapshots == 3
    assert report.collectors["tcp"].status is CollectorState.UNAVAILABLE
    assert "CAP_BPF" in (report.collectors["tcp"].reason or "")
    assert "boom" in (report.collectors["gpu"].reason or "")
    assert report.exit_code() == 0


def _render(name: str) -> str:
    t = SCENARIOS[name].build()
    report = diagnose.analyze(iter(t.snapshots), Analyzer(backends=t.backends()), source=f"scenario {name}")
    buf = io.StringIO()
    render_report(report, Console(file=buf, width=100, color_system=None, force_terminal=False, highlight=False))
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines()) + "\n"


@pytest.mark.parametrize("name", ["queue_avalanche", "gpu_fault", "healthy"])
def test_rich_report_golden(name: str) -> None:
    golden = GOLDEN / f"diagnose_{name}.txt"
    text = _render(name)
    if os.environ.get("LLMDIAG_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert golden.exists(), f"missing {golden}; run with LLMDIAG_UPDATE_GOLDEN=1 once and review it"
    assert text == golden.read_text()


def test_cli_unknown_collector_is_a_clear_error(capsys) -> None:
    from llmdiag.cli.diagnose import run

    class Args:
        replay = None
        duration = 1.0
        json = True
        width = None

    config = Config.from_toml('[agent]\ncollectors = ["nosuch"]\ndiscover = false\n')
    assert run(Args(), config) == 64  # EX_USAGE: never confused with 2 = critical
    assert "nosuch" in capsys.readouterr().err
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        Args.duration = bad
        assert run(Args(), config) == 64
        assert "--duration must be a positive number" in capsys.readouterr().err

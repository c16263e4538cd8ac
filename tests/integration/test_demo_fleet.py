"""The demo fleet starts, serves (HTTP and gRPC), and everything it started stops: on stop(), and
when ``llmdiag demo`` gets Ctrl-C or SIGTERM (which still prints the report of what was seen)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from llmdiag.model import read_snapshots
from llmdiag.sim.demo_fleet import DemoFleet

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def _refused(url: str) -> bool:
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex((host, int(port))) != 0


def _taken(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
        return False


def test_fleet_serves_then_stops_everything() -> None:
    before = {t.name for t in threading.enumerate()}
    fleet = DemoFleet(fault_at=60)
    fleet.reserve_ports()
    planned = {b.name: b.url for b in fleet.backends()}
    assert set(planned) == {"vllm-0", "vllm-1", "vllm-2", "vllm-3", "vllm-4", "vllm-3-grpc"}
    # Reserved means held: nothing else can bind a planned port before the engines do.
    for url in planned.values():
        assert _taken(int(url.rsplit(":", 1)[1])), url
    fleet.start()
    try:
        assert {b.name: b.url for b in fleet.backends()} == planned  # the reserved ports were used
        for name, url in fleet.urls.items():
            with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
                assert resp.status == 200, name
        # The gRPC port's metrics are its engine's: vllm-3-grpc's metrics_url is vllm-3's /metrics, and it answers.
        grpc_backend = next(b for b in fleet.backends() if b.name == "vllm-3-grpc")
        assert grpc_backend.metrics_url == fleet.urls["vllm-3"] + "/metrics"
        with urllib.request.urlopen(grpc_backend.metrics_url, timeout=5) as resp:
            assert resp.status == 200 and b"vllm:time_to_first_token_seconds" in resp.read()
        time.sleep(1.5)
        assert fleet.stats.sent > 0
    finally:
        fleet.stop()
    for url in planned.values():
        assert _refused(url), url
    assert "llmdiag-demo-fleet" not in {t.name for t in threading.enumerate()} - before


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_demo_interrupted_prints_the_report_and_stops_its_engines(tmp_path: Path, sig: signal.Signals) -> None:
    recording = tmp_path / "demo.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmdiag.cli", "demo", "--no-live", "--duration", "300", "--fault-at", "200",
         "--record", str(recording), "--config", str(_engine_only(tmp_path))],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={"PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (not recording.exists() or len(recording.read_text().splitlines()) < 3):
            # A demo that ended early says why on stderr: fail with it now rather than after the deadline.
            if proc.poll() is not None:
                out, err = proc.communicate()
                pytest.fail(f"demo exited with {proc.returncode} before recording 3 snapshots:\n{out}\n{err}")
            time.sleep(0.5)
        assert recording.exists() and recording.read_text().count("\n") >= 3, (
            "fewer than 3 snapshots recorded within 60 s: " + _stop_and_tell(proc))
        snaps = list(read_snapshots(recording))
        urls = sorted(snaps[0].backends)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode in (0, 1, 2), err
    assert "verdict:" in out and "recorded" in out, out + err
    # The engine collector scrapes vllm-3-grpc too: through its metrics_url (vllm-3's /metrics).
    assert urls == ["vllm-0", "vllm-1", "vllm-2", "vllm-3", "vllm-3-grpc", "vllm-4"]


def _stop_and_tell(proc: subprocess.Popen[str]) -> str:
    proc.kill()
    out, err = proc.communicate(timeout=30)
    return f"stdout:\n{out}\nstderr:\n{err}"


def _engine_only(tmp_path: Path) -> Path:
    # Only the engine collector: this test is about stopping, not about the kernel collectors.
    path = tmp_path / "engine-only.toml"
    path.write_text('[agent]\ncollectors = ["engine"]\n')
    return path

"""The demo end to end, as a person runs it: ``llmdiag demo --record FILE``, then ``diagnose --replay FILE``.

150 s of five fake engines on loopback under real load, watched by the real
collectors (BPF tcp and http2 included: root) and analyzers; the recording
is then diagnosed offline, with no config: each scripted fault must be named
on the backend it was done to (the timeout storm on ``vllm-3`` and on its gRPC
port ``vllm-3-grpc``), and the healthy control must stay clean.
This is the suite's one long test.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from llmdiag.model import Labelled, label_key, read_snapshots

pytestmark = [pytest.mark.root, pytest.mark.timeout(400)]

REPO = Path(__file__).resolve().parents[2]


def _llmdiag(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llmdiag.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


def test_demo_recording_names_each_fault_on_its_backend(tmp_path: Path) -> None:
    recording = tmp_path / "demo.jsonl.gz"
    demo = _llmdiag("demo", "--no-live", "--duration", "150", "--fault-at", "30", "--record", str(recording), timeout=330)
    assert demo.returncode in (1, 2), demo.stdout + demo.stderr
    assert "recorded" in demo.stdout
    snapshots = list(read_snapshots(recording))
    assert len(snapshots) >= 140
    for name in ("tcp", "timewait", "http2", "engine"):
        assert snapshots[-1].collectors[name].status.value == "ok", (name, snapshots[-1].collectors[name])
    # The gRPC client's cancels reached the backend as RST_STREAM(CANCEL), seen by the http2 collector.
    rst = snapshots[-1].backends["vllm-3-grpc"]["h2_rst_stream_total"]
    assert isinstance(rst, Labelled) and rst.get(label_key(code="CANCEL", direction="received"), 0) > 20, rst

    replay = _llmdiag("diagnose", "--replay", str(recording), "--json", timeout=120)
    assert replay.returncode == 2, replay.stderr
    report = json.loads(replay.stdout)
    found: dict[str, set[str]] = {}
    worst: dict[str, str] = {}
    for d in report["diagnoses"]:
        found.setdefault(d["backend"], set()).add(d["kind"])
        if d["severity"] in ("warning", "critical"):
            worst[d["backend"]] = d["severity"]
    summary = json.dumps({b: sorted(k) for b, k in found.items()})
    assert found.get("vllm-1", set()) & {"connection_churn", "timewait_exhaustion"}, summary
    assert found.get("vllm-2", set()) & {"kv_cache_saturation", "queue_avalanche", "false_healthy"}, summary
    assert "client_timeout_storm" in found.get("vllm-3", set()), summary
    # The gRPC port: its own RST_STREAM(CANCEL) joined with the engine's TTFT, read through its metrics_url.
    assert "ttft_seconds" in snapshots[-1].backends["vllm-3-grpc"], snapshots[-1].backends["vllm-3-grpc"]
    assert "client_timeout_storm" in found.get("vllm-3-grpc", set()), summary
    assert "backend_down" in found.get("vllm-4", set()), summary
    assert "vllm-0" not in worst, summary  # the healthy control: nothing at warning or worse

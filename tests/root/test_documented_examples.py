"""The collect examples of `collect --help` and docs/http2.md run as written (they need BPF):
each prints a snapshot, then stops at Ctrl-C with exit 130."""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.root

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "llmdiag.cli"]


def _examples() -> list[str]:
    help_text = subprocess.run([*CLI, "collect", "--help"], capture_output=True, text=True, timeout=60).stdout
    http2 = (REPO / "docs" / "http2.md").read_text(encoding="utf-8")
    wanted = {
        "collect --help": ("llmdiag collect --collectors tcp,timewait --backend http://127.0.0.1:8000 --json", help_text),
        "docs/http2.md": ("llmdiag collect --collectors http2 --backend grpc://127.0.0.1:50051 --json", http2),
    }
    for where, (example, text) in wanted.items():
        assert example in text, f"{where} no longer shows `{example}`: update this test with it"
    return [example for example, _ in wanted.values()]


@pytest.mark.parametrize("example", _examples())
def test_example_runs_as_written(example: str) -> None:
    proc = subprocess.Popen([*CLI, *shlex.split(example)[1:]], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # runs until Ctrl-C: one snapshot is enough
        assert first, proc.stderr.read() if proc.stderr else ""
        snapshot = json.loads(first)
        assert snapshot["schema"] == "llmdiag.snapshot/v1"
        name = shlex.split(example)[3].split(",")[0]
        # Running: ok, or degraded when nothing listens on the example's port on this host.
        assert snapshot["collectors"][name]["status"] in ("ok", "degraded"), snapshot["collectors"]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)  # drains stdout, so a full pipe cannot block the exit
        assert proc.returncode == 130, err
        assert "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)

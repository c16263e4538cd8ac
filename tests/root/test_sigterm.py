"""SIGTERM stops a long-running command like Ctrl-C: its BPF programs are detached and it exits 130."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.root


def _tcp_health_programs() -> int:
    out = subprocess.run(["bpftool", "prog", "show"], capture_output=True, text=True, timeout=30).stdout
    return out.count("name tracepoint__sock__inet_sock_set_state") + out.count("name raw_tracepoint__sock_send_length")


def test_sigterm_detaches_and_exits() -> None:
    before = _tcp_health_programs()
    proc = subprocess.Popen([sys.executable, "-m", "llmdiag.cli", "collect", "--collectors", "tcp", "--json",
                             "--interval", "0.2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # the program is loaded once a snapshot comes out
        assert '"tcp"' in first, first + (proc.stderr.read() if proc.poll() is not None and proc.stderr else "")
        assert _tcp_health_programs() > before
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 10
    while _tcp_health_programs() > before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _tcp_health_programs() == before

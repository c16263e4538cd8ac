"""Without root (or CAP_BPF+CAP_PERFMON) the BPF collectors say so, with the way out, never a bare PermissionError."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmdiag.agent.wiring import build_collectors
from llmdiag.bpf import features
from llmdiag.config import Config
from llmdiag.model import Backend, CollectorState


@pytest.fixture
def not_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    monkeypatch.setattr(features, "capabilities", lambda: {})
    monkeypatch.setattr(features, "bcc_available", lambda: features.Probe(True, "bcc (test)"))

    real_is_dir = Path.is_dir

    def is_dir(self: Path) -> bool:  # tracefs is mode 0700: a user cannot even stat events/
        if "tracing" in str(self) and str(self).endswith("events"):
            raise PermissionError(13, "Permission denied", str(self))
        return real_is_dir(self)

    monkeypatch.setattr(Path, "is_dir", is_dir)


def test_tracefs_that_cannot_be_read_is_not_found_rather_than_an_exception(not_root: None) -> None:
    assert features.tracefs_root() is None


def test_tcp_and_cuda_as_a_user_name_the_missing_permission_with_a_hint(not_root: None) -> None:
    backends = [Backend.from_url("http://127.0.0.1:9", name="b0", pid=1)]
    running, unavailable = build_collectors(Config(), backends, ["tcp", "cuda"])
    assert running == []
    for name in ("tcp", "cuda"):
        status = unavailable[name]
        assert status.status is CollectorState.UNAVAILABLE
        assert "not root (and no CAP_BPF+CAP_PERFMON)" in status.reason, status.reason
        assert "hint: run as root or grant CAP_BPF, CAP_PERFMON" in status.reason, status.reason
        assert "PermissionError" not in status.reason

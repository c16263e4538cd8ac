"""The root/gpu tiers behave as documented: skip normally, fail under LLMDIAG_REQUIRE_BPF=1."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path


def _run_inner(tmp_path: Path, repo_dir: Path, env_extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    test = tmp_path / "test_inner.py"
    test.write_text(textwrap.dedent(
        """
        import pytest

        @pytest.mark.root
        def test_needs_root():
            pass
        """
    ))
    (tmp_path / "conftest.py").write_text((repo_dir / "tests" / "conftest.py").read_text())
    # Pretend to be unprivileged: run as nobody is not possible without setuid, so fake
    # the "cannot run" reason through headers living in a missing modules root.
    env = {**os.environ, **env_extra}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
         "-o", "markers=root: r", str(test)],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120,
    )


def test_root_test_fails_when_required_but_unavailable(tmp_path: Path, repo_dir: Path) -> None:
    # LLMDIAG_FORCE_ROOT_UNAVAILABLE makes the conftest report a reason, as on a machine without BPF.
    proc = _run_inner(tmp_path, repo_dir, {"LLMDIAG_REQUIRE_BPF": "1", "LLMDIAG_FORCE_ROOT_UNAVAILABLE": "simulated"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "LLMDIAG_REQUIRE_BPF=1 but this root test cannot run: simulated" in proc.stdout


def test_root_test_skips_when_not_required(tmp_path: Path, repo_dir: Path) -> None:
    env = {"LLMDIAG_FORCE_ROOT_UNAVAILABLE": "simulated"}
    proc = _run_inner(tmp_path, repo_dir, {**env, "LLMDIAG_REQUIRE_BPF": "0"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 skipped" in proc.stdout

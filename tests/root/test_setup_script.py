"""scripts/setup.sh is idempotent: on a machine it already set up, it changes nothing."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.root


def test_second_run_installs_nothing(repo_dir: Path) -> None:
    env = {**os.environ, "LLMDIAG_VENV": os.environ.get("LLMDIAG_VENV", ".venv")}
    proc = subprocess.run(["bash", "scripts/setup.sh"], cwd=repo_dir, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[setup]")]
    # Everything was installed by the `make test` that is running this test, so the only line is the last.
    assert lines == [f"[setup] ready: {env['LLMDIAG_VENV']}/bin/llmdiag"], proc.stdout


def test_headers_for_bcc_are_in_place() -> None:
    build = Path("/lib/modules") / os.uname().release / "build"
    assert (build / "include").is_dir() or Path("/sys/kernel/kheaders.tar.xz").exists()

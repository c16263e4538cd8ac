"""The layering of SPEC section 1 is enforced by import-linter contracts in pyproject.toml."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path


def _lint_imports() -> list[str]:
    exe = Path(sys.executable).with_name("lint-imports")
    return [str(exe)] if exe.exists() else [shutil.which("lint-imports") or "lint-imports"]


def test_import_contracts_hold(repo_dir: Path) -> None:
    proc = subprocess.run(_lint_imports(), capture_output=True, text=True, cwd=repo_dir, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Contracts: 2 kept, 0 broken." in proc.stdout


def test_contracts_catch_a_violation(tmp_path: Path, repo_dir: Path) -> None:
    """A copy of the package with one upward import must break the layers contract."""
    shutil.copytree(repo_dir / "llmdiag", tmp_path / "llmdiag", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(repo_dir / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "llmdiag" / "collectors" / "_violation.py").write_text("import llmdiag.cli.main\nimport rich\n")
    proc = subprocess.run(_lint_imports(), capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert proc.returncode != 0
    assert "llmdiag.collectors._violation -> llmdiag.cli.main" in proc.stdout
    assert "Contracts: 0 kept, 2 broken." in proc.stdout

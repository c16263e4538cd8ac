"""The layering of SPEC section 1 is enforced by import-linter contracts in pyproject.toml.

The contracts are read from pyproject.toml, so adding one needs no change here:
every declared contract must be reported KEPT, and an upward import must break
the layers contract and the rich/textual one, each reported by name.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any


def _lint_imports() -> list[str]:
    exe = Path(sys.executable).with_name("lint-imports")
    return [str(exe)] if exe.exists() else [shutil.which("lint-imports") or "lint-imports"]


def _contracts(repo_dir: Path) -> list[dict[str, Any]]:
    data = tomllib.loads((repo_dir / "pyproject.toml").read_text(encoding="utf-8"))
    return data["tool"]["importlinter"]["contracts"]


def _verdicts(stdout: str) -> str:
    """lint-imports wraps long contract names over lines: one space-separated string to search."""
    return " ".join(stdout.split())


def _summary(stdout: str) -> tuple[int, int]:
    match = re.search(r"Contracts: (\d+) kept, (\d+) broken\.", stdout)
    assert match, stdout
    return int(match.group(1)), int(match.group(2))


def test_import_contracts_hold(repo_dir: Path) -> None:
    contracts = _contracts(repo_dir)
    assert any(c["type"] == "layers" for c in contracts)
    proc = subprocess.run(_lint_imports(), capture_output=True, text=True, cwd=repo_dir, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    verdicts = _verdicts(proc.stdout)
    for contract in contracts:
        assert f"{' '.join(contract['name'].split())} KEPT" in verdicts, contract["name"]
    assert _summary(proc.stdout) == (len(contracts), 0)


def test_contracts_catch_a_violation(tmp_path: Path, repo_dir: Path) -> None:
    """A copy of the package with one upward import must break the layers contract."""
    shutil.copytree(repo_dir / "llmdiag", tmp_path / "llmdiag", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(repo_dir / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "llmdiag" / "collectors" / "_violation.py").write_text("import llmdiag.cli.main\nimport rich\n")
    proc = subprocess.run(_lint_imports(), capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert proc.returncode != 0
    assert "llmdiag.collectors._violation -> llmdiag.cli.main" in proc.stdout
    contracts = _contracts(repo_dir)
    layers = [c for c in contracts if c["type"] == "layers"]
    no_rich = [c for c in contracts if "rich" in c.get("forbidden_modules", ())]
    assert layers and no_rich, "pyproject.toml lost the layers or the no-rich contract"
    verdicts = _verdicts(proc.stdout)
    for contract in layers + no_rich:
        assert f"{' '.join(contract['name'].split())} BROKEN" in verdicts, contract["name"]
    kept, broken = _summary(proc.stdout)
    assert kept + broken == len(contracts) and broken >= 2

"""The command line: --help lists exactly the registered commands, and each one parses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from llmdiag.cli.main import COMMAND_MODULES, build_parser, main

PROC_FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "proc" / "host618"


def _subcommands() -> list[str]:
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return list(action.choices)  # type: ignore[union-attr]


def test_every_module_registers_one_command() -> None:
    assert len(_subcommands()) == len(COMMAND_MODULES)


@pytest.mark.parametrize("command", _subcommands())
def test_command_help(command: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "llmdiag.cli", command, "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert f"usage: llmdiag {command}" in proc.stdout


def test_top_level_help_lists_commands() -> None:
    proc = subprocess.run([sys.executable, "-m", "llmdiag.cli", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    for command in _subcommands():
        assert command in proc.stdout


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 64
    assert "usage: llmdiag" in capsys.readouterr().out


def test_collect_rejects_unknown_collector(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["collect", "--once", "--collectors", "no_such_collector", "--json"]) == 64
    assert "unknown collector(s): no_such_collector" in capsys.readouterr().err


def test_collect_once_then_record_and_replay(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    # A recorded /proc tree, so the test does not depend on this host having PSI (CONFIG_PSI).
    config = tmp_path / "proc.toml"
    config.write_text(f'[proc]\nproc_root = "{PROC_FIXTURE}"\n')
    assert main(["--config", str(config), "collect", "--once", "--interval", "0.05", "--collectors", "proc", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["schema"] == "llmdiag.snapshot/v1"
    assert doc["collectors"]["proc"]["status"] == "ok"
    assert doc["host"]["psi_cpu_some_avg10"] == pytest.approx(0.0154)  # fixture pressure/cpu: some avg10=1.54
    path = tmp_path / "rec.jsonl.gz"
    assert main(["--config", str(config), "collect", "--duration", "0.15", "--interval", "0.05", "--collectors", "proc",
                 "--record", str(path)]) == 0
    assert "recorded 3 snapshot(s)" in capsys.readouterr().err
    assert main(["diagnose", "--replay", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["diagnoses"] == []


@pytest.mark.parametrize("argv", [
    ["collect", "--interval", "0"],
    ["collect", "--duration", "inf"],
    ["demo", "--rate", "0"],
    ["demo", "--duration", "-5"],
    ["fake-engine", "--port", "70000"],
    ["fake-engine", "--kv-capacity", "-5"],
    ["diagnose", "--duration", "abc"],
    ["--backend", "ftp://x:1", "diagnose"],
])
def test_usage_mistakes_exit_64_never_a_traceback(argv: list[str]) -> None:
    # 64 (EX_USAGE), not argparse's 2, which `diagnose` and `demo` use for "critical".
    proc = subprocess.run([sys.executable, "-m", "llmdiag.cli", *argv], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 64, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr


def test_record_to_an_unwritable_path_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["collect", "--once", "--interval", "0.05", "--collectors", "proc", "--record", "/nonexistent/dir/x.jsonl"]) == 1
    assert "cannot write /nonexistent/dir/x.jsonl" in capsys.readouterr().err

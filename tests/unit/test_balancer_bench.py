"""``llmdiag bench balancer --json``: the JSON shape (timings are not asserted)."""

from __future__ import annotations

import argparse
import json

import pytest

from llmdiag.cli import bench
from llmdiag.config import Config


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="llmdiag")
    bench.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.handler(args, Config())


def test_bench_balancer_json_shape(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["bench", "balancer", "--json", "--iterations", "50"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["pick_ns"]) == {"10", "100", "1000"}
    for cell in [*result["pick_ns"].values(), result["on_finish_ns"], result["on_first_token_ns"]]:
        assert set(cell) == {"p50", "p99"}
        assert isinstance(cell["p50"], int) and isinstance(cell["p99"], int)
        assert 0 <= cell["p50"] <= cell["p99"]
    assert result["iterations"] == 50


def test_bench_balancer_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["bench", "balancer", "--iterations", "20", "--backends", "3,30"]) == 0
    out = capsys.readouterr().out
    assert "pick, 3 backends" in out and "pick, 30 backends" in out and "on_finish" in out


def test_bench_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["bench", "balancer", "--backends", "ten"]) == 64  # EX_USAGE
    assert "--backends" in capsys.readouterr().err
    assert run(["bench"]) == 64

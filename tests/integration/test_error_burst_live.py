"""A fake engine answering half its requests with 500 under real load fires error_burst."""

from __future__ import annotations

import json

import pytest
from live_engine import llmdiag, loaded_engine

pytestmark = pytest.mark.integration


def test_half_5xx_under_load_is_an_error_burst(tmp_path) -> None:
    with loaded_engine("error_5xx:start=0,ratio=0.5", rps=25) as engine:
        run = llmdiag("--backend", engine.url, "diagnose", "--duration", "5", "--json",
                      config='[agent]\ncollectors = ["engine"]\n', cwd=tmp_path)
        statuses = dict(engine.statuses)
    assert statuses.get("500", 0) > 10 and statuses.get("200", 0) > 10, statuses
    report = json.loads(run.stdout)
    (burst,) = [d for d in report["diagnoses"] if d["kind"] == "error_burst"]
    ratio = next(e for e in burst["evidence"] if e["signal"] == "responses_total error ratio")["value"]
    assert 0.3 <= ratio <= 0.7  # about half, as the fault says
    assert burst["severity"] == "critical" and run.returncode == 2  # >= critical_ratio (20 %)
    assert "server_5xx" in burst["summary"]

"""A fake engine that crashes under real load is ``backend_down``: critical, penalty 1, exit 2."""

from __future__ import annotations

import json

import pytest
from live_engine import llmdiag, loaded_engine

pytestmark = pytest.mark.integration

ENGINE_ONLY = '[agent]\ncollectors = ["engine"]\n'


def test_engine_that_crashes_under_load_is_backend_down(tmp_path) -> None:
    with loaded_engine("crash:start=2,down=60", rps=20) as engine:
        run = llmdiag("--backend", engine.url, "diagnose", "--duration", "6", "--json", config=ENGINE_ONLY, cwd=tmp_path)
        statuses = dict(engine.statuses)
    assert statuses.get("200", 0) > 0 and statuses.get("refused", 0) > 0, statuses  # it served, then died
    assert run.returncode == 2, run.stderr
    report = json.loads(run.stdout)
    (down,) = [d for d in report["diagnoses"] if d["kind"] == "backend_down"]
    assert down["severity"] == "critical" and down["penalty"] == 1.0 and down["open"]
    evidence = {e["signal"]: e for e in down["evidence"]}
    assert evidence["scrape_failure"]["value"] == "connection_refused"
    assert "kv_cache_usage (last seen)" in evidence  # what it looked like before it went
    (health,) = report["backends"].values()
    assert health["penalty"] == 1.0


@pytest.mark.parametrize(
    ("url_of", "failure"),
    [
        (lambda port: f"http://127.0.0.1:{port}", "connection_refused"),
        (lambda port: "http://no-such-engine.invalid:8000", "name_not_resolved"),
    ],
    ids=["refused", "unresolved"],
)
def test_a_backend_that_never_answered_is_critical(tmp_path, url_of, failure) -> None:
    import socket

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = llmdiag("--backend", url_of(port), "diagnose", "--duration", "3", "--json", config=ENGINE_ONLY, cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    (down,) = json.loads(run.stdout)["diagnoses"]
    assert down["kind"] == "backend_down"
    assert {e["signal"]: e["value"] for e in down["evidence"]}["scrape_failure"] == failure
    assert "never answered" in down["summary"]


def test_an_engine_that_restarts_closes_backend_down_with_hysteresis(tmp_path) -> None:
    # Dies at 1 s, answers again at 4 s (no warm-up): opened after two refused scrapes, held
    # while the first answers come in, closed once it has answered for recover_seconds (3).
    with loaded_engine("crash:start=1,down=3,warmup_s=0", rps=10) as engine:
        run = llmdiag("--backend", engine.url, "diagnose", "--duration", "11", "--json", config=ENGINE_ONLY, cwd=tmp_path)
    assert run.returncode == 2, run.stderr  # a critical diagnosis happened during the run
    report = json.loads(run.stdout)
    (down,) = [d for d in report["diagnoses"] if d["kind"] == "backend_down"]
    assert not down["open"] and down["closed_at"] - down["since"] >= 3 + 3 - 1  # down ~3 s, then held 3 s
    (health,) = report["backends"].values()
    assert health["penalty"] < 1.0  # answering again at the end: no longer ejected


def test_engine_that_stalls_under_load_is_engine_stalled_while_its_metrics_answer(tmp_path) -> None:
    # The engine stops making progress at 1 s and stays stalled; its /metrics keeps answering.
    with loaded_engine("stall:start=1,duration=60", rps=10) as engine:
        run = llmdiag("--backend", engine.url, "diagnose", "--duration", "9", "--json", config=ENGINE_ONLY, cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    report = json.loads(run.stdout)
    kinds = {d["kind"] for d in report["diagnoses"]}
    assert "backend_down" not in kinds  # it answers: not down
    (stalled,) = [d for d in report["diagnoses"] if d["kind"] == "engine_stalled"]
    assert stalled["severity"] == "critical" and stalled["open"]
    evidence = {e["signal"].rpartition(".")[2]: e["value"] for e in stalled["evidence"]}  # engines[0].requests_running
    assert evidence["requests_running"] + evidence["requests_waiting"] > 0
    assert evidence["stalled_seconds"] >= 5.0

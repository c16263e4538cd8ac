"""``llmdiag scrape URL``: two real scrapes over HTTP, JSON and table output, exit codes."""

from __future__ import annotations

import json

import pytest
from engine_http import SHARED_ENGINES, metrics_server
from test_engine_collector import bump_histogram

from llmdiag.cli.main import main

SYNTH = (SHARED_ENGINES / "vllm_SYNTHETIC_current_v1_names_text0.0.4.prom").read_text()


def test_scrape_json_has_per_engine_and_backend_signals_with_window_quantiles(capsys):
    second = bump_histogram(SYNTH, "vllm:time_to_first_token_seconds", "1", 7.5, 10, 60.0)
    with metrics_server(SYNTH, second) as server:
        code = main(["scrape", server.url, "--json", "--interval", "0.1"])
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["url"] == server.url and doc["engine"] == "vllm" and doc["up"] is True
    assert set(doc["engines"]) == {"0", "1"}
    assert doc["engines"]["1"]["requests_waiting"] == 87
    assert doc["engines"]["1"]["kv_cache_usage"] == pytest.approx(0.987)
    assert doc["signals"]["kv_cache_usage"] == pytest.approx(0.987)
    # SPEC 3.2 encodings: a distribution object and a labelled object keyed "reason=..."
    assert doc["engines"]["1"]["ttft_seconds"] == {"p50": 6.25, "p99": pytest.approx(7.475), "ewma": 6.0, "count": 10}
    assert doc["signals"]["requests_finished_total"]["reason=abort"] == 60
    assert doc["signals"]["up"] == 1


def test_scrape_once_leaves_quantiles_na(capsys):
    with metrics_server(SYNTH) as server:
        assert main(["scrape", server.url + "/metrics", "--json", "--interval", "0"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["signals"]["ttft_seconds"] == {"p50": None, "p99": None, "ewma": None, "count": None}


def test_scrape_table(capsys):
    with metrics_server(SYNTH) as server:
        assert main(["scrape", server.url, "--interval", "0"]) == 0
    out = capsys.readouterr().out
    assert "engine 1" in out and "kv_cache_usage" in out and "0.987" in out and "N/A" in out


def test_scrape_of_a_dead_port_exits_1(capsys):
    with metrics_server("x") as server:
        url = server.url
    assert main(["scrape", url, "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["up"] is False and doc["error"] == "connection refused" and doc["signals"]["up"] == 0


def test_scrape_of_a_bad_url_exits_64(capsys):
    assert main(["scrape", "ftp://x:1", "--json"]) == 64
    assert "scheme" in capsys.readouterr().err

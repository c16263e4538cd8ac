"""A real Prometheus scrapes a real ``llmdiag agent`` (with a bearer token) watching two fake engines."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
from pathlib import Path

import pytest

from agent_support import AgentProcess, fake_engines, free_port, get_json, metric_value, stop, wait_for

pytestmark = pytest.mark.integration

FAST = """
[agent]
interval_seconds = 0.5
discover = false
collectors = ["engine", "proc", "timewait"]
"""


def _need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.fail(f"{tool} is not installed (scripts/setup.sh installs it)")
    return path


def test_promtool_and_prometheus_read_the_agent(tmp_path: Path) -> None:
    promtool, prometheus = _need("promtool"), _need("prometheus")
    token = "integration-token-7f3a"
    (tmp_path / "token").write_text(token + "\n")
    with fake_engines([[], []]) as urls:
        agent = AgentProcess(["--backend", urls[0], "--backend", urls[1], "--token-file", str(tmp_path / "token")],
                             tmp_path, config=FAST, token=token, agent_check=False)
        prom = None
        try:
            agent.wait_ready(ticks=3)
            text = agent.metrics()
            lint = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
            assert lint.returncode == 0 and not lint.stdout.strip() and not lint.stderr.strip(), lint.stdout + lint.stderr
            backend = urls[0].removeprefix("http://")
            assert metric_value(text, "llmdiag_backend_up", backend=backend) == 1
            assert metric_value(text, "llmdiag_backend_info", backend=backend, address=backend) == 1
            assert metric_value(text, "process_resident_memory_bytes") > 0

            port = free_port()
            config = tmp_path / "prometheus.yml"
            config.write_text(json.dumps({  # YAML is a superset of JSON
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "scrape_configs": [{
                    "job_name": "llmdiag", "scrape_interval": "500ms", "scrape_timeout": "400ms",
                    "authorization": {"type": "Bearer", "credentials_file": str(tmp_path / "token")},
                    "static_configs": [{"targets": [f"127.0.0.1:{agent.port}"]}],
                }],
            }))
            prom = subprocess.Popen([prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                     f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                                    stderr=(tmp_path / "prometheus.log").open("w"), text=True)

            def query(expr: str) -> list[dict]:
                url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
                doc = get_json(url)
                assert doc["status"] == "success", doc
                return doc["data"]["result"]

            score = wait_for("Prometheus to have the backend's score",
                             lambda: query(f'llmdiag_backend_score{{backend="{backend}"}}'), 60, 0.5)
            assert len(score) == 1 and score[0]["metric"]["job"] == "llmdiag"
            value = float(score[0]["value"][1])
            assert 0 <= value <= 100
            agent_scores = {b["name"]: b["score"] for b in agent.penalties()["backends"]}
            assert backend in agent_scores
            up = query('up{job="llmdiag"}')
            assert [float(r["value"][1]) for r in up] == [1.0]  # the token was accepted
            assert float(query("llmdiag_ticks_total")[0]["value"][1]) >= 3
        finally:
            if prom is not None:
                stop(prom)  # type: ignore[arg-type]
            code, log, took = agent.stop()
        assert code == 0, log
        assert took < 5, log

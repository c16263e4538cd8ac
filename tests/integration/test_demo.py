"""``llmdiag demo`` end to end: real fake engines on loopback, real collectors and analyzers.

The fleet's vllm-2 loses 75 % of its KV cache and throttles two seconds in; within
the run llmdiag must name it (and only it) and the balancer must route away from it.
"""

from __future__ import annotations

import re

import pytest

from llmdiag.cli.main import main


# Wall-clock runs of real engines on loopback (tens of seconds): the integration tier.
pytestmark = pytest.mark.integration


def test_demo_names_the_drowning_engine(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["demo", "--duration", "35", "--fault-at", "2", "--no-live"])
    out = capsys.readouterr().out
    assert code in (1, 2), out
    sections = re.split(r"\n(?=vllm-\d  )", out)
    by_backend = {s.split()[0]: s for s in sections if s.startswith("vllm-")}
    assert set(by_backend) == {"vllm-0", "vllm-1", "vllm-2"}, out
    assert "degraded" in by_backend["vllm-2"].splitlines()[0], out
    kinds = {"kv_cache_saturation", "false_healthy", "queue_avalanche", "client_timeout_storm"}
    assert any(k in by_backend["vllm-2"] for k in kinds), out
    for healthy in ("vllm-0", "vllm-1"):
        assert "WARNING" not in by_backend[healthy] and "CRITICAL" not in by_backend[healthy], out
    weights = dict(re.findall(r"(vllm-\d) (\d+)%", out.split("routing weights at the end:")[1]))
    assert int(weights["vllm-2"]) < min(int(weights["vllm-0"]), int(weights["vllm-1"])), out

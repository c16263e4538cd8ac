"""Replaying a recording gives the same diagnoses as the live run that recorded it.

The live leg is real: fake vLLM engines on 127.0.0.1 under load (one of them
going bad), scraped by the real engine and /proc collectors.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from llmdiag.analyzers import Analyzer
from llmdiag.agent.loop import analyze
from llmdiag.agent.ticker import snapshot_ticks
from llmdiag.config import Config
from llmdiag.model import Backend, read_snapshots, write_snapshots
from llmdiag.sim.demo_fleet import DemoFleet, FleetEngine
from llmdiag.sim.faults import parse_faults


# Wall-clock runs of real engines on loopback (tens of seconds): the integration tier.
pytestmark = pytest.mark.integration


def test_replay_equals_live(tmp_path: Path) -> None:
    config = Config()
    config = dataclasses.replace(config, agent=dataclasses.replace(config.agent, interval_seconds=0.5))
    # vllm-2 keeps 15 % of its KV cache and a third of its speed from the first second.
    bad = parse_faults("kv_shrink:start=1,factor=0.15;slowdown:start=1,speed=0.33")
    fleet = DemoFleet([FleetEngine("vllm-0"), FleetEngine("vllm-1"), FleetEngine("vllm-2", faults=bad)], rate_rps=3.0)
    fleet.start()
    try:
        backends = [Backend.from_url(url, name=name, engine="vllm") for name, url in fleet.urls.items()]
        recorded = []

        def recording():
            for snap in snapshot_ticks(config, backends, ["engine", "proc"], duration=20):
                recorded.append(snap)
                yield snap

        live = analyze(recording(), Analyzer(config, backends=backends), source="live")
    finally:
        fleet.stop()
    path = tmp_path / "run.jsonl.gz"
    assert write_snapshots(path, recorded) == 40
    replay = analyze(read_snapshots(path), Analyzer(config, backends=backends), source="replay")
    assert replay.to_json() == live.to_json()
    assert any(d["backend"] == "vllm-2" for d in live.to_json()["diagnoses"]), live.to_json()

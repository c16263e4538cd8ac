"""The real NVML path (needs an NVIDIA GPU; skipped elsewhere)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from llmdiag.collectors.gpu import GpuCollector
from llmdiag.collectors.nvml import Nvml
from llmdiag.model import CollectorState, Snapshot

pytestmark = pytest.mark.gpu


def test_real_gpus_give_device_signals() -> None:
    import pynvml

    pynvml.nvmlInit()
    count = pynvml.nvmlDeviceGetCount()
    pynvml.nvmlShutdown()
    c = GpuCollector(Nvml(), pcie_interval_seconds=0.5)
    try:
        c.collect(time.time())
        time.sleep(1.0)
        snap = Snapshot(ts=time.time())
        snap.extend(c.collect(time.time()))
        assert c.status().status is CollectorState.OK, c.status().reason
    finally:
        c.close()
    assert sorted(snap.gpus, key=int) == [str(i) for i in range(count)]
    for signals in snap.gpus.values():
        assert signals["memory_total_bytes"] > 0
        assert signals["memory_used_bytes"] <= signals["memory_total_bytes"]
        util = signals["gpu_utilization"]
        assert util != util or 0.0 <= util <= 1.0  # NA (NaN) or a ratio
        assert isinstance(signals["throttle_reasons"], dict) or signals["throttle_reasons"] != signals["throttle_reasons"]
    json.loads(snap.dumps())


def test_real_recording_replays(tmp_path: Path) -> None:
    import pynvml

    from llmdiag.collectors.nvml_replay import record

    doc = record(pynvml, ticks=2, interval_seconds=0.2, provenance="gpu test")
    path = tmp_path / "real.json"
    path.write_text(json.dumps(doc))
    c = GpuCollector.from_replay(path, xid_events=False)
    try:
        snap = Snapshot(ts=0)
        snap.extend(c.collect(0.0))
    finally:
        c.close()
    assert len(snap.gpus) == len(doc["devices"]) and all(s["memory_total_bytes"] > 0 for s in snap.gpus.values())

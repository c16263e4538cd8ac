"""The allocator exporter's metrics, on an engine's own /metrics, become allocator_* signals."""

from __future__ import annotations

from engine_http import SHARED_ENGINES, ScriptedServer
from prometheus_client import CollectorRegistry, generate_latest

from llmdiag.collectors.allocator_exporter import register
from llmdiag.collectors.engine import EngineCollector
from llmdiag.config.engine import EngineConfig
from llmdiag.model import Backend, Scope, Snapshot

GiB = 1 << 30


def _allocator_text(retries: int, ooms: int) -> str:
    stats = {
        0: {"reserved_bytes.all.current": 40 * GiB, "allocated_bytes.all.current": 30 * GiB,
            "inactive_split_bytes.all.current": 6 * GiB, "num_alloc_retries": retries, "num_ooms": ooms},
        1: {"reserved_bytes.all.current": 40 * GiB, "allocated_bytes.all.current": 38 * GiB,
            "inactive_split_bytes.all.current": 2 * GiB, "num_alloc_retries": 0, "num_ooms": 0},
    }
    registry = CollectorRegistry()
    register(registry, stats_source=lambda device: stats[device], devices=[0, 1])
    return generate_latest(registry).decode()


def test_allocator_metrics_map_to_signals_and_fragmentation_ratio() -> None:
    vllm = (SHARED_ENGINES / "vllm_v1_real_scrape_0.9era.prom").read_text()
    bodies = [vllm + _allocator_text(retries=1, ooms=0), vllm + _allocator_text(retries=4, ooms=1)]
    with ScriptedServer({"/metrics": bodies}) as server:
        collector = EngineCollector([Backend.from_url(server.url, name="b", engine="vllm")], EngineConfig())
        snaps = []
        for now in (100.0, 101.0):
            snap = Snapshot(ts=now)
            snap.extend(collector.collect(now))
            snaps.append(snap)
    signals = snaps[-1].signals_for(Scope.BACKEND, "b")
    assert signals["allocator_reserved_bytes"] == 80 * GiB  # summed over the two devices
    assert signals["allocator_allocated_bytes"] == 68 * GiB
    assert signals["allocator_inactive_split_bytes"] == 8 * GiB
    assert signals["allocator_alloc_retries_total"] == 4
    assert signals["allocator_ooms_total"] == 1
    assert signals["allocator_fragmentation_ratio"] == 8 / 80  # inactive_split / reserved
    assert signals["kv_cache_usage"] is not None  # the engine's own signals are still read

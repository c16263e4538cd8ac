"""The allocator exporter on a real prometheus_client registry, scraped over HTTP on 127.0.0.1."""

from __future__ import annotations

import logging
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from llmdiag.collectors.allocator_exporter import ALLOCATOR_METRICS, register

# Shaped like torch.cuda.memory_stats() (a flat dict of "stat.pool.kind" keys), trimmed to what we read plus neighbours.
STATS = {
    0: {"reserved_bytes.all.current": 70_866_960_384, "reserved_bytes.all.peak": 71_000_000_000,
        "allocated_bytes.all.current": 52_613_349_376, "inactive_split_bytes.all.current": 6_442_450_944,
        "num_alloc_retries": 3, "num_ooms": 1, "num_sync_all_streams": 0},
    1: {"reserved_bytes.all.current": 1_073_741_824, "allocated_bytes.all.current": 536_870_912,
        "inactive_split_bytes.all.current": 0, "num_alloc_retries": 0, "num_ooms": 0},
}


def scrape(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        port = server.server_address[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("llmdiag_allocator_"):
                out[(s.name, s.labels["device"])] = s.value
    return out


def test_exports_every_field_per_device_over_http() -> None:
    registry = CollectorRegistry()
    register(registry, stats_source=lambda d: STATS[d], devices=[0, 1])
    got = scrape(registry)
    assert got[("llmdiag_allocator_reserved_bytes", "0")] == 70_866_960_384
    assert got[("llmdiag_allocator_allocated_bytes", "0")] == 52_613_349_376
    assert got[("llmdiag_allocator_inactive_split_bytes", "0")] == 6_442_450_944
    assert got[("llmdiag_allocator_alloc_retries_total", "0")] == 3
    assert got[("llmdiag_allocator_ooms_total", "0")] == 1
    assert got[("llmdiag_allocator_reserved_bytes", "1")] == 1_073_741_824
    assert len(got) == 2 * len(ALLOCATOR_METRICS)


def test_stats_are_read_at_scrape_time() -> None:
    live = {"reserved_bytes.all.current": 1, "num_ooms": 0}
    registry = CollectorRegistry()
    register(registry, stats_source=lambda d: live, devices=[0])
    assert scrape(registry)[("llmdiag_allocator_ooms_total", "0")] == 0
    live["num_ooms"] = 2
    got = scrape(registry)
    assert got[("llmdiag_allocator_ooms_total", "0")] == 2
    # keys this torch version does not report are absent, not zero
    assert ("llmdiag_allocator_allocated_bytes", "0") not in got


def test_failing_source_never_breaks_the_engine_scrape(caplog: pytest.LogCaptureFixture) -> None:
    def source(device: int) -> dict:
        if device == 1:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return STATS[0]

    registry = CollectorRegistry()
    register(registry, stats_source=source, devices=[0, 1])
    with caplog.at_level(logging.WARNING):
        got = scrape(registry)
        scrape(registry)
    assert ("llmdiag_allocator_ooms_total", "0") in got and ("llmdiag_allocator_ooms_total", "1") not in got
    assert sum("illegal memory access" in r.getMessage() for r in caplog.records) == 1  # once, not per scrape


def test_without_torch_exports_nothing_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:  # pragma: no cover
        pytest.skip("torch is installed here")
    registry = CollectorRegistry()
    register(registry)
    with caplog.at_level(logging.WARNING):
        assert scrape(registry) == {}
    assert any("cannot list CUDA devices" in r.getMessage() for r in caplog.records)


def test_name_clash_is_refused_at_register() -> None:
    registry = CollectorRegistry()
    register(registry, stats_source=lambda d: STATS[0], devices=[0])
    with pytest.raises(ValueError, match="Duplicated"):
        register(registry, stats_source=lambda d: STATS[0], devices=[0])

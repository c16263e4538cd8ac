"""The GPU collector on replayed NVML answers: every signal, not-supported, lost GPUs, XID and PCIe threads."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from llmdiag.agent.wiring import COLLECTOR_FACTORIES
from llmdiag.collectors.base import GuardedCollector, collect_snapshot
from llmdiag.collectors.gpu import DEVICE_SIGNALS, GpuCollector
from llmdiag.collectors.nvml_replay import ReplayError
from llmdiag.config import Config, ConfigError
from llmdiag.model import NA, Backend, CollectorState, Sample, Scope, Snapshot

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
H200 = FIXTURES / "nvml" / "h200x8.json"
NOT_SUPPORTED = FIXTURES / "nvml" / "not_supported.json"
PROC_TREE = FIXTURES / "proc" / "host618"
MIB = 1 << 20
TOTAL = 143771 * MIB


def gpus(samples: list[Sample]) -> dict[str, dict]:
    snap = Snapshot(ts=0)
    snap.extend(samples)
    return snap.gpus


def wait_for(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


@pytest.fixture
def h200():
    c = GpuCollector.from_replay(H200, proc_root=PROC_TREE)
    yield c
    c.close()


def test_every_device_signal_on_a_healthy_tick(h200: GpuCollector) -> None:
    g = gpus(h200.collect(1.0))
    assert sorted(g) == [str(i) for i in range(8)]
    used = int(0.9 * TOTAL) - 540 * MIB + 512 * MIB
    for i in range(8):
        s = g[str(i)]
        assert set(DEVICE_SIGNALS) | {"xid_errors_total", "pcie_rx_bytes_per_second", "pcie_tx_bytes_per_second"} == set(s)
        assert s["gpu_utilization"] == pytest.approx(sum([97, 95, 99, 100, 96, 98]) / 6 / 100)
        assert s["gpu_utilization_peak"] == 1.0
        assert s["memory_total_bytes"] == TOTAL
        assert s["memory_used_bytes"] == used
        assert s["memory_reserved_bytes"] == 540 * MIB
        assert s["power_watts"] == pytest.approx(612.345)
        assert s["temperature_celsius"] == 63
        assert s["sm_clock_hz"] == 1980e6
        assert s["throttle_reasons"] == {}
        assert s["ecc_uncorrected_total"] == 0
        assert s["xid_errors_total"] == {}
        assert s["pcie_rx_bytes_per_second"] == 2_400_000 * 1024
        assert s["pcie_tx_bytes_per_second"] == 1_100_000 * 1024
        assert s["process_memory_bytes"][f"pid={4101 + i}"] == int(0.9 * TOTAL) - 540 * MIB
    assert g["0"]["process_memory_bytes"]["pid=9999"] == 512 * MIB
    assert h200.status().status is CollectorState.OK


def test_throttle_ecc_xid_and_utilization_fallback(h200: GpuCollector) -> None:
    h200.collect(1.0)
    g = gpus(h200.collect(2.0))
    assert g["2"]["throttle_reasons"] == {"reason=hw_thermal_slowdown": 1, "reason=sw_power_cap": 1}
    assert g["2"]["sm_clock_hz"] == 1410e6 and g["2"]["temperature_celsius"] == 87 and g["2"]["power_watts"] == 700.0
    assert g["2"]["gpu_utilization"] == pytest.approx(sum([60, 55, 58, 62, 57, 61]) / 600)
    assert g["2"]["gpu_utilization_peak"] == pytest.approx(0.62)
    assert g["3"]["ecc_uncorrected_total"] == 1
    # GPU 7 has no samples newer than the last tick: nvmlDeviceGetUtilizationRates answers, no peak.
    assert g["7"]["gpu_utilization"] == pytest.approx(0.88)
    assert g["7"]["gpu_utilization_peak"] is NA
    # XID 48 on GPU 3 arrives through the event thread.
    assert wait_for(lambda: gpus(h200._xid_samples())["3"]["xid_errors_total"] == {"xid=48": 1})
    assert h200.status().status is CollectorState.OK


def test_lost_gpu_is_na_and_degraded_never_a_crash(h200: GpuCollector) -> None:
    for t in (1.0, 2.0):
        h200.collect(t)
    g = gpus(h200.collect(3.0))
    for name in DEVICE_SIGNALS + ("pcie_rx_bytes_per_second", "pcie_tx_bytes_per_second"):
        assert g["5"][name] is NA, name
    assert g["4"]["memory_total_bytes"] == TOTAL  # the others carry on
    st = h200.status()
    assert st.status is CollectorState.DEGRADED and "GPU 5 is lost" in st.reason
    assert wait_for(lambda: gpus(h200._xid_samples())["5"]["xid_errors_total"] == {"xid=79": 1})
    g = gpus(h200.collect(4.0))  # still lost on the next tick (the handle cannot be reopened)
    assert g["5"]["gpu_utilization"] is NA
    assert "GPU 5 is lost" in h200.status().reason
    doc = Snapshot(ts=4.0, gpus=g).to_json()
    assert doc["gpus"]["5"]["memory_used_bytes"] is None  # NA serialises as null
    json.dumps(doc, allow_nan=False)


def test_lost_gpu_recovers_when_found_again(tmp_path: Path) -> None:
    doc = {"format": "llmdiag.nvml-replay/v1", "devices": [{}], "ticks": [
        {"nvmlDeviceGetTemperature": {"*": 40}}, {"lost": [0]}, {"found": [0]}]}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(doc))
    c = GpuCollector.from_replay(path, xid_events=False, pcie_interval_seconds=0)
    try:
        assert gpus(c.collect(1))["0"]["temperature_celsius"] == 40
        assert gpus(c.collect(2))["0"]["temperature_celsius"] is NA
        assert c.status().status is CollectorState.DEGRADED
        assert gpus(c.collect(3))["0"]["temperature_celsius"] == 40
        assert c.status().status is CollectorState.OK
    finally:
        c.close()


def test_not_supported_paths_fall_back_or_give_na() -> None:
    c = GpuCollector.from_replay(NOT_SUPPORTED)
    try:
        s = gpus(c.collect(1.0))["0"]
    finally:
        c.close()
    assert s["gpu_utilization"] == pytest.approx(0.35)  # samples not supported -> utilization rates
    assert s["gpu_utilization_peak"] is NA
    assert s["memory_total_bytes"] == 8192 * MIB and s["memory_used_bytes"] == 2048 * MIB  # v2 missing -> v1
    assert s["memory_reserved_bytes"] is NA
    assert s["throttle_reasons"] == {"reason=gpu_idle": 1}  # old driver: ClocksThrottleReasons name
    for name in ("process_memory_bytes", "power_watts", "ecc_uncorrected_total", "xid_errors_total",
                 "pcie_rx_bytes_per_second", "pcie_tx_bytes_per_second"):
        assert s[name] is NA, name
    assert s["temperature_celsius"] == 54 and s["sm_clock_hz"] == 1607e6
    # A missing metric is just NA; the collector is fine.
    assert c.status().status is CollectorState.OK


def test_no_driver_is_unavailable_with_a_hint_and_retries_later() -> None:
    now = [100.0]
    c = GpuCollector.from_replay(FIXTURES / "nvml" / "no_driver.json", init_retry_seconds=30, clock=lambda: now[0])
    assert c.collect(1.0) == []
    st = c.status()
    assert st.status is CollectorState.UNAVAILABLE
    assert "NVML_ERROR_DRIVER_NOT_LOADED" in st.reason and "hint:" in st.reason
    calls = c.nvml._library.calls
    c.collect(2.0)  # within the retry interval: no new nvmlInit attempt
    assert c.status().status is CollectorState.UNAVAILABLE
    assert c.nvml._library.calls == calls
    c.close()


def test_processes_are_attributed_to_backends_through_parent_pids(h200: GpuCollector) -> None:
    # vLLM's API server is pid 4100; its tensor-parallel workers 4101..4108 hold the GPU memory.
    h200.set_backends([Backend("vllm-0", "http://127.0.0.1:8000", pid=4100), Backend("other", "http://127.0.0.1:9000", pid=77)])
    snap = Snapshot(ts=1)
    snap.extend(h200.collect(1.0))
    per_worker = int(0.9 * TOTAL) - 540 * MIB
    assert snap.backends["vllm-0"]["gpu_memory_bytes"] == 8 * per_worker
    labelled = snap.backends["vllm-0"]["process_memory_bytes"]
    assert labelled["gpu=3,pid=4104"] == per_worker and len(labelled) == 8
    assert "other" not in snap.backends  # pid 9999 belongs to nobody


def test_xid_thread_starts_and_stops_cleanly(h200: GpuCollector) -> None:
    before = {t.name for t in threading.enumerate()}
    h200.collect(1.0)
    assert "llmdiag-nvml-xid" in {t.name for t in threading.enumerate()} - before
    h200.close()
    assert "llmdiag-nvml-xid" not in {t.name for t in threading.enumerate()}
    assert h200.nvml._library.initialised == 0  # nvmlShutdown was called
    h200.close()  # idempotent


def test_xid_events_can_be_turned_off() -> None:
    c = GpuCollector.from_replay(H200, xid_events=False)
    try:
        g = gpus(c.collect(1.0))
        assert "xid_errors_total" not in g["0"]
        assert not any(t.name == "llmdiag-nvml-xid" for t in threading.enumerate())
    finally:
        c.close()


def test_pcie_inline_cadence_and_background_thread(tmp_path: Path) -> None:
    doc = json.loads(H200.read_text())
    doc["ticks"] = doc["ticks"][:1]  # one steady tick, so every tick makes the same calls
    steady = tmp_path / "steady.json"
    steady.write_text(json.dumps(doc))
    c = GpuCollector.from_replay(steady, xid_events=False, pcie_interval_seconds=10)
    try:
        c.collect(100.0)
        calls = c.nvml._library.calls
        c.collect(101.0)  # PCIe not due: the 8 GPUs x 2 PCIe calls are not repeated
        per_tick = c.nvml._library.calls - calls
        calls = c.nvml._library.calls
        c.collect(110.0)
        assert c.nvml._library.calls - calls == per_tick + 16
        assert gpus(c.collect(111.0))["7"]["pcie_tx_bytes_per_second"] == 1_100_000 * 1024  # cached between samples
    finally:
        c.close()
    t = GpuCollector.from_replay(H200, xid_events=False, pcie_interval_seconds=0.05, pcie_in_thread=True)
    try:
        t.collect(1.0)
        assert wait_for(lambda: "pcie_rx_bytes_per_second" in gpus(t.collect(2.0))["0"])
        assert any(th.name == "llmdiag-nvml-pcie" for th in threading.enumerate())
    finally:
        t.close()
    assert not any(th.name == "llmdiag-nvml-pcie" for th in threading.enumerate())


def test_pcie_disabled() -> None:
    c = GpuCollector.from_replay(H200, xid_events=False, pcie_interval_seconds=0)
    try:
        assert "pcie_rx_bytes_per_second" not in gpus(c.collect(1.0))["0"]
    finally:
        c.close()


def test_guarded_snapshot_json_round_trip(h200: GpuCollector) -> None:
    snap = collect_snapshot([GuardedCollector(h200)], now=5.0)
    doc = json.loads(snap.dumps())
    assert doc["collectors"]["gpu"]["status"] == "ok"
    assert doc["gpus"]["0"]["throttle_reasons"] == {}
    assert Snapshot.from_json(doc).gpus["1"]["memory_total_bytes"] == TOTAL


def test_config_and_wiring(tmp_path: Path) -> None:
    config = Config.from_toml(f'[gpu]\nreplay_file = "{H200}"\npcie_interval_seconds = 2.5\nxid_events = false\n[proc]\nproc_root = "{PROC_TREE}"\n')
    c = COLLECTOR_FACTORIES["gpu"](config, [Backend("vllm-0", "http://127.0.0.1:8000", pid=4100)])
    try:
        assert isinstance(c, GpuCollector) and c.pcie_interval_seconds == 2.5 and not c.xid_events
        snap = Snapshot(ts=1)
        snap.extend(c.collect(1.0))
        assert len(snap.gpus) == 8 and "gpu_memory_bytes" in snap.backends["vllm-0"]
    finally:
        c.close()
    with pytest.raises(ConfigError, match="pcie_interval_seconds"):
        Config.from_toml("[gpu]\npcie_interval_seconds = -1\n")
    with pytest.raises(ConfigError, match="gpu.replay_fil"):
        Config.from_toml('[gpu]\nreplay_fil = "x"\n')
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    with pytest.raises(ReplayError, match="format"):
        COLLECTOR_FACTORIES["gpu"](Config.from_toml(f'[gpu]\nreplay_file = "{bad}"\n'), [])


def test_real_nvml_factory_without_driver_reports_unavailable() -> None:
    # The default factory uses the real pynvml; on this GPU-less machine it must degrade to "unavailable".
    c = COLLECTOR_FACTORIES["gpu"](Config(), [])
    try:
        samples = c.collect(1.0)
        if c.status().status is not CollectorState.UNAVAILABLE:  # pragma: no cover - a GPU host
            pytest.skip("NVML works here")
        assert samples == [] and "hint:" in c.status().reason
    finally:
        c.close()


def test_samples_use_gpu_scope_with_index_subject(h200: GpuCollector) -> None:
    samples = h200.collect(1.0)
    gpu_samples = [s for s in samples if s.scope is Scope.GPU]
    assert {s.subject for s in gpu_samples} == {str(i) for i in range(8)}


def _failing_init(code_name: str):
    from llmdiag.collectors.nvml_replay import ReplayNvml

    return ReplayNvml({"format": "llmdiag.nvml-replay/v1", "devices": [], "init_error": code_name, "ticks": [{}]})


def test_no_nvidia_software_is_a_status_not_a_warning_and_a_broken_driver_warns_once(caplog, monkeypatch) -> None:
    import logging

    from llmdiag.collectors import gpu as gpu_module
    from llmdiag.collectors.nvml import Nvml

    monkeypatch.setattr(gpu_module, "_LOGGED_UNAVAILABLE", set())  # this process may have warned already

    with caplog.at_level(logging.INFO, logger="llmdiag.collectors.gpu"):
        for _ in range(2):  # two commands' worth of collectors in one process
            absent = GpuCollector(Nvml(_failing_init("NVML_ERROR_LIBRARY_NOT_FOUND")), [], xid_events=False)
            absent.collect(1.0)
            status = absent.status()
            assert status.status is CollectorState.UNAVAILABLE and "libnvidia-ml.so.1 not found" in status.reason
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.INFO]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="llmdiag.collectors.gpu"):
        for _ in range(3):
            GpuCollector(Nvml(_failing_init("NVML_ERROR_DRIVER_NOT_LOADED")), [], xid_events=False).collect(1.0)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "DRIVER_NOT_LOADED" in warnings[0].getMessage()

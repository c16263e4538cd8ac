"""The NVML choke point and the replay backend (no GPU: pynvml's types and errors, replayed answers)."""

from __future__ import annotations

import json
from pathlib import Path

import pynvml
import pytest

from llmdiag.collectors import nvml as nv
from llmdiag.collectors.nvml import QUERIES, GpuLost, Nvml, NvmlUnavailable, decode_clock_event_reasons
from llmdiag.collectors.nvml_replay import ReplayError, ReplayHandle, ReplayNvml
from llmdiag.model import NA

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nvml"


def replay(doc: dict) -> Nvml:
    n = Nvml(ReplayNvml(doc))
    n.init()
    n.advance()
    return n


def one_gpu(**answers: object) -> dict:
    return {"format": "llmdiag.nvml-replay/v1", "devices": [{"name": "g"}], "ticks": [answers]}


def test_copied_constants_match_pynvml() -> None:
    # nvml.py copies NVML's ABI constants so the call list needs no pynvml import; keep them honest.
    assert nv.NVML_MEMORY_V2 == pynvml.nvmlMemory_v2
    assert nv.NVML_GPU_UTILIZATION_SAMPLES == pynvml.NVML_GPU_UTILIZATION_SAMPLES
    assert nv.NVML_CLOCK_SM == pynvml.NVML_CLOCK_SM
    assert nv.NVML_TEMPERATURE_GPU == pynvml.NVML_TEMPERATURE_GPU
    assert nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    assert nv.NVML_VOLATILE_ECC == pynvml.NVML_VOLATILE_ECC
    assert (nv.NVML_PCIE_UTIL_RX_BYTES, nv.NVML_PCIE_UTIL_TX_BYTES) == (pynvml.NVML_PCIE_UTIL_RX_BYTES, pynvml.NVML_PCIE_UTIL_TX_BYTES)
    assert nv.NVML_EVENT_TYPE_XID_CRITICAL_ERROR == pynvml.nvmlEventTypeXidCriticalError
    for name, code in nv.ERROR_CODES.items():
        assert getattr(pynvml, name) == code, name
    for bit, name in nv.CLOCK_EVENT_REASONS.items():
        const = "nvmlClocksEventReason" + "".join(p.capitalize() for p in name.split("_"))
        assert getattr(pynvml, const) == bit, const


def test_every_query_function_exists_in_pynvml() -> None:
    for q in QUERIES.values():
        assert callable(getattr(pynvml, q.function)), q.function
        assert callable(getattr(ReplayNvml, q.function)), q.function


def test_decode_clock_event_reasons() -> None:
    assert decode_clock_event_reasons(0) == []
    assert decode_clock_event_reasons(0x44) == ["sw_power_cap", "hw_thermal_slowdown"]
    assert decode_clock_event_reasons(pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown) == ["hw_power_brake_slowdown"]
    assert decode_clock_event_reasons(0x401) == ["gpu_idle", "unknown_0x400"]


def test_choke_point_turns_not_supported_into_na_and_remembers_why() -> None:
    n = replay(one_gpu(nvmlDeviceGetPowerUsage={"0": {"error": "NVML_ERROR_NOT_SUPPORTED"}},
                       nvmlDeviceGetTemperature={"0": 61}))
    assert n.query(0, "power") is NA
    assert n.na_causes[(0, "nvmlDeviceGetPowerUsage")] == "NVML_ERROR_NOT_SUPPORTED"
    assert n.query(0, "temperature") == 61
    # A key the recording never gave is "not supported" too.
    assert n.query(0, "ecc_uncorrected") is NA


@pytest.mark.parametrize("error", ["NVML_ERROR_NO_PERMISSION", "NVML_ERROR_FUNCTION_NOT_FOUND", "NVML_ERROR_UNKNOWN", "NVML_ERROR_TIMEOUT"])
def test_other_errors_are_na_too(error: str) -> None:
    n = replay(one_gpu(**{"nvmlDeviceGetClockInfo.sm": {"0": {"error": error}}}))
    assert n.query(0, "sm_clock") is NA
    assert n.na_causes[(0, "nvmlDeviceGetClockInfo.sm")] == error


def test_gpu_is_lost_raises_gpu_lost() -> None:
    n = replay(one_gpu(nvmlDeviceGetPowerUsage={"0": {"error": "NVML_ERROR_GPU_IS_LOST"}}))
    with pytest.raises(GpuLost) as info:
        n.query(0, "power")
    assert info.value.index == 0 and "GPU_IS_LOST" in str(info.value)


def test_replay_returns_pynvml_types() -> None:
    doc = json.loads((FIXTURES / "h200x8.json").read_text())
    n = replay(doc)
    mem = n.query(0, "memory_v2")
    assert isinstance(mem, pynvml.c_nvmlMemory_v2_t)
    assert mem.total == 143771 * 2**20 and mem.version == pynvml.nvmlMemory_v2
    assert isinstance(n.query(0, "utilization"), pynvml.c_nvmlUtilization_t)
    value_type, samples = n.query(0, "samples", 0)
    assert value_type == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
    assert all(isinstance(s, pynvml.c_nvmlSample_t) for s in samples)
    assert [s.sampleValue.uiVal for s in samples] == [97, 95, 99, 100, 96, 98]
    # nothing newer than the last sample: the driver answers NOT_FOUND, the choke point NA
    assert n.query(0, "samples", samples[-1].timeStamp) is NA
    procs = n.query(0, "processes")
    assert isinstance(procs[0], pynvml.nvmlFriendlyObject) and procs[0].pid == 4101


def test_replay_answers_are_sticky_and_star_restates() -> None:
    doc = {"format": "llmdiag.nvml-replay/v1", "devices": [{}, {}], "ticks": [
        {"nvmlDeviceGetTemperature": {"*": 50, "1": 70}},
        {"nvmlDeviceGetPowerUsage": {"0": 1000}},
        {"nvmlDeviceGetTemperature": {"*": 55}},
    ]}
    n = replay(doc)
    assert (n.query(0, "temperature"), n.query(1, "temperature")) == (50, 70)
    n.advance()
    assert (n.query(0, "temperature"), n.query(1, "temperature"), n.query(0, "power")) == (50, 70, 1000)
    n.advance()
    assert (n.query(0, "temperature"), n.query(1, "temperature")) == (55, 55)
    n.advance()  # past the end: stays on the last tick
    assert n.query(1, "temperature") == 55


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"devices": [], "ticks": [{}]}, "format"),
        ({"format": "llmdiag.nvml-replay/v1", "devices": [], "ticks": []}, "ticks"),
        ({"format": "llmdiag.nvml-replay/v1", "devices": [], "ticks": [{"nvmlDeviceGetBogus": {}}]}, "unknown keys"),
        ({"format": "llmdiag.nvml-replay/v1", "devices": [], "ticks": [{"nvmlDeviceGetPowerUsage": 5}]}, "must map"),
        ({"format": "llmdiag.nvml-replay/v1", "devices": [], "ticks": [{"events": [{"device": "x"}]}]}, "bad event"),
        ({"format": "llmdiag.nvml-replay/v1", "devices": [], "init_error": "NOPE", "ticks": [{}]}, "init_error"),
    ],
)
def test_bad_replay_documents_are_clear_errors(doc: dict, message: str) -> None:
    with pytest.raises(ReplayError, match=message):
        ReplayNvml(doc)


def test_bad_replay_file(tmp_path: Path) -> None:
    with pytest.raises(ReplayError, match="cannot read"):
        ReplayNvml.from_file(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ReplayError, match="not JSON"):
        ReplayNvml.from_file(tmp_path / "bad.json")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read NVML replay"),
        (b"\x7fELF\x02\x01\x01\x00\xff\xfe", "is not text"),
        (b"{not json", "is not JSON"),
        (b'{"format": "something/else"}', "want a JSON object"),
    ],
    ids=["missing", "binary", "not-json", "wrong-format"],
)
def test_an_unusable_replay_file_is_a_usage_error_naming_the_file(tmp_path: Path, content: bytes | None, message: str) -> None:
    from llmdiag.collectors.base import CollectorUsageError
    from llmdiag.collectors.gpu import GpuCollector
    from llmdiag.collectors.nvml_replay import ReplayFileError

    path = tmp_path / "replay.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ReplayFileError, match=message) as raised:
        GpuCollector.from_replay(path)
    assert isinstance(raised.value, CollectorUsageError) and str(path) in str(raised.value)


def test_init_failures_are_unavailable_with_a_hint() -> None:
    n = Nvml(ReplayNvml.from_file(FIXTURES / "no_driver.json"))
    with pytest.raises(NvmlUnavailable) as info:
        n.init()
    assert "NVML_ERROR_DRIVER_NOT_LOADED" in info.value.reason
    assert "nvidia-smi" in info.value.hint
    doc = {"format": "llmdiag.nvml-replay/v1", "init_error": "NVML_ERROR_LIBRARY_NOT_FOUND", "devices": [], "ticks": [{}]}
    with pytest.raises(NvmlUnavailable) as info:
        Nvml(ReplayNvml(doc)).init()
    assert "libnvidia-ml.so.1" in info.value.hint


def test_real_pynvml_without_a_driver_is_unavailable_not_a_crash() -> None:
    # This machine has pynvml but no libnvidia-ml: the real init path must say so.
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:  # pragma: no cover - a GPU host
        pynvml.nvmlShutdown()
        pytest.skip("NVML works here; covered by the gpu-marked test")
    with pytest.raises(NvmlUnavailable) as info:
        Nvml().init()
    assert info.value.hint


def test_event_set_wait_times_out_then_delivers() -> None:
    doc = {"format": "llmdiag.nvml-replay/v1", "devices": [{}], "ticks": [{}, {"events": [{"device": 0, "type": "xid", "data": 79}]}]}
    lib = ReplayNvml(doc)
    n = Nvml(lib)
    n.init()
    es = n.call("nvmlEventSetCreate")
    n.call("nvmlDeviceRegisterEvents", n.handle(0), pynvml.nvmlEventTypeXidCriticalError, es)
    n.advance()
    with pytest.raises(pynvml.NVMLError_Timeout):
        n.call("nvmlEventSetWait", es, 10)
    n.advance()
    event = n.call("nvmlEventSetWait", es, 10)
    assert (event.eventType, event.eventData, event.device) == (pynvml.nvmlEventTypeXidCriticalError, 79, ReplayHandle(0))
    n.call("nvmlEventSetFree", es)


def test_malformed_replay_answer_is_na_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    # {"gpu": ...} without "memory" makes the replay fail inside the call: NA, one warning, no crash.
    n = replay(one_gpu(nvmlDeviceGetUtilizationRates={"0": {"gpu": 50}}))
    with caplog.at_level("WARNING", logger="llmdiag.collectors.nvml"):
        assert n.query(0, "utilization") is NA
        assert n.query(0, "utilization") is NA
    assert len([r for r in caplog.records if "nvmlDeviceGetUtilizationRates" in r.getMessage()]) == 1

"""Every catalog kind on synthetic timelines: positives open, traps stay quiet, hysteresis holds."""

from __future__ import annotations

import dataclasses

import pytest

from llmdiag.analyzers import Analyzer
from llmdiag.analyzers.rules.gpu import throttle_names
from llmdiag.analyzers.timelines import SCENARIOS, TimelineBuilder, dist
from llmdiag.config import Config
from llmdiag.config.analyzers import DiagnosisConfig
from llmdiag.exporters.penalties import penalties_document
from llmdiag.model import DIAGNOSIS_KINDS, HOST, BackendState, Diagnosis, Labelled, PenaltiesDocument, Severity

POSITIVE = [s for s in SCENARIOS.values() if s.expect]
NEGATIVE = [s for s in SCENARIOS.values() if not s.expect]


def _run(t: TimelineBuilder, config: DiagnosisConfig | None = None, backends: bool = True):
    a = Analyzer(config or DiagnosisConfig(), backends=t.backends() if backends else None)
    opened: list[Diagnosis] = []
    results = []
    for snap in t.snapshots:
        r = a.observe(snap)
        opened.extend(r.opened)
        results.append(r)
    return a, opened, results


def test_every_catalog_kind_has_a_positive_scenario() -> None:
    assert {k for s in POSITIVE for k in s.expect} == set(DIAGNOSIS_KINDS)


@pytest.mark.parametrize("scenario", POSITIVE, ids=lambda s: s.name)
def test_positive_scenario_opens_its_kind_with_evidence(scenario) -> None:
    _, opened, results = _run(scenario.build())
    kinds = {(d.kind, d.backend) for d in opened}
    for kind in scenario.expect:
        assert (kind, scenario.backend) in kinds, f"{kind} did not open on {scenario.backend}: {kinds}"
    assert {k for k, _ in kinds} <= set(scenario.expect) | set(scenario.allow)
    for d in opened:
        assert d.evidence and all(e.signal for e in d.evidence)
        assert d.remediation and d.summary
    # healthy peers stay unpenalised
    final = results[-1].backends
    assert final["vllm-1"].penalty == 0.0 and final["vllm-1"].state is BackendState.HEALTHY


@pytest.mark.parametrize("scenario", NEGATIVE, ids=lambda s: s.name)
def test_trap_scenario_opens_nothing(scenario) -> None:
    _, opened, results = _run(scenario.build())
    assert opened == []
    assert all(h.penalty == 0.0 for h in results[-1].backends.values())


def test_kv_packed_without_queue_is_info_with_small_penalty_and_stays_healthy() -> None:
    _, opened, results = _run(SCENARIOS["kv_packed_no_queue"].build())
    (d,) = opened
    assert d.severity is Severity.INFO and d.penalty == pytest.approx(0.1)
    assert results[-1].backends["vllm-0"].state is BackendState.HEALTHY


def test_kv_saturation_needs_three_seconds() -> None:
    t = TimelineBuilder().advance(40)
    t.backend("vllm-0").set(kv_cache_usage=0.9)
    a = Analyzer(backends=t.backends())
    ts_open = None
    for snap in t.advance(6).snapshots:
        r = a.observe(snap)
        if r.opened:
            ts_open = snap.ts
    assert ts_open == t.start + 40 + 4  # first high at +41, held 3 s at +44
    assert a.open_diagnoses()[0].since == t.start + 41


def test_hysteresis_holds_between_exit_and_enter_and_closes_below_exit() -> None:
    t = TimelineBuilder().advance(40)
    b = t.backend("vllm-0")
    b.set(kv_cache_usage=0.9)
    t.advance(5)
    b.set(kv_cache_usage=0.82)  # below enter, above exit: stays open however long
    t.advance(30)
    n_before_close = len(t.snapshots)
    b.set(kv_cache_usage=0.5)
    t.advance(20)
    a, opened, results = _run(t)
    assert [d.kind for d in opened] == ["kv_cache_saturation"]
    assert results[n_before_close - 1].open  # still open at 0.82
    closes = [r for r in results if r.closed]
    assert len(closes) == 1
    # Closed at the first tick below exit once hold_seconds (10) had passed since opening.
    assert closes[0].ts == t.start + 40 + 5 + 30 + 1


def test_min_hold_keeps_a_short_spike_open() -> None:
    t = TimelineBuilder().advance(40)
    t.backend("vllm-0").set(kv_cache_usage=0.95)
    t.advance(4)
    t.backend("vllm-0").set(kv_cache_usage=0.3)
    t.advance(15)
    _, opened, results = _run(t)
    opened_at = next(r.ts for r in results if r.opened)
    closed_at = next(r.ts for r in results if r.closed)
    assert closed_at - opened_at >= 10.0


def test_detected_but_not_enforced() -> None:
    cfg = Config.from_toml("[diagnosis.kv_cache_saturation]\nenforce = false\n").diagnosis
    a, opened, results = _run(SCENARIOS["kv_cache_saturation"].build(), cfg)
    assert [d.kind for d in opened] == ["kv_cache_saturation"]
    assert a.detected_total == {"kv_cache_saturation": 1}
    assert a.enforced_total == {}
    assert results[-1].backends["vllm-0"].penalty == 0.0


def test_disabled_rule_does_not_run() -> None:
    cfg = Config.from_toml("[diagnosis.gpu_fault]\nenabled = false\n").diagnosis
    _, opened, _ = _run(SCENARIOS["gpu_fault"].build(), cfg)
    assert opened == []


def test_penalties_combine_and_build_the_document() -> None:
    a, _, results = _run(SCENARIOS["queue_avalanche"].build())
    health = results[-1].backends["vllm-0"]
    expected = 1.0
    for d in a.open_diagnoses():
        if d.backend == "vllm-0":
            expected *= 1 - d.penalty
    assert health.penalty == pytest.approx(1 - expected)
    assert health.state is BackendState.DEGRADED
    assert [r.kind for r in health.reasons][0] == "queue_avalanche"  # largest penalty first
    doc = penalties_document(results[-1].ts, "sim-node", results[-1].backends, {"vllm-0": "127.0.0.1:8000"})
    back = PenaltiesDocument.from_json(__import__("json").loads(doc.dumps()))
    entry = {b.name: b for b in back.backends}["vllm-0"]
    assert entry.address == "127.0.0.1:8000"
    assert entry.score == pytest.approx(100 * (1 - health.penalty), abs=1e-3)
    assert entry.weight_percent == round(entry.score)
    assert {b.name: b for b in back.backends}["vllm-1"].weight_percent == 100


def test_gpu_diagnosis_goes_to_host_when_gpus_cannot_be_attributed() -> None:
    t = SCENARIOS["gpu_fault"].build()
    for snap in t.snapshots:  # no backend pid known: the gpu collector attributes no process
        for signals in snap.backends.values():
            signals.pop("process_memory_bytes", None)
            signals.pop("gpu_memory_bytes", None)
    _, opened, _ = _run(t, backends=False)
    assert [(d.kind, d.backend) for d in opened] == [("gpu_fault", HOST)]


def test_gpu_diagnosis_is_attributed_from_process_memory_alone() -> None:
    # No Backend list at all: the gpu collector's process_memory_bytes{gpu,pid} names the owner.
    _, opened, _ = _run(SCENARIOS["gpu_fault"].build(), backends=False)
    assert [(d.kind, d.backend) for d in opened] == [("gpu_fault", "vllm-0")]


def test_fault_severity_is_critical_and_penalty_large() -> None:
    _, opened, results = _run(SCENARIOS["gpu_fault"].build())
    assert opened[0].severity is Severity.CRITICAL
    assert results[-1].backends["vllm-0"].penalty >= 0.9


def test_baseline_is_frozen_while_a_diagnosis_is_open() -> None:
    t = TimelineBuilder().advance(40)
    t.backend("vllm-0").set(requests_waiting=40.0, ttft_seconds=dist(3.0))
    t.advance(120)  # two minutes of overload
    a, _, _ = _run(t)
    assert a.baselines.get("vllm-0/ttft_ewma") == pytest.approx(0.3, rel=0.05)


def test_gateway_error_ratio_ignores_client_quota() -> None:
    t = TimelineBuilder().advance(40)
    b = t.backend("vllm-0")
    b.rate("responses_total", 50.0, **{"class": "client_ratelimit_429"}).rate("responses_total", 0.1, **{"class": "server_5xx"})
    _, opened, _ = _run(t.advance(30))
    assert opened == []


def test_throttle_reasons_from_labels_or_nvml_bitmask() -> None:
    assert throttle_names(Labelled({"reason=HwThermalSlowdown": 1.0, "reason=gpu_idle": 0.0})) == {"hw_thermal_slowdown"}
    assert throttle_names(0x4 | 0x40) == {"sw_power_cap", "hw_thermal_slowdown"}
    assert throttle_names(None) == set()


def test_bad_config_is_rejected_with_the_key() -> None:
    from llmdiag.config import ConfigError

    with pytest.raises(ConfigError, match="queue_avalanche"):
        Config.from_toml("[diagnosis.queue_avalanche]\nwaiting_enter = 10\nwaiting_exit = 20\n")
    with pytest.raises(ConfigError, match="diagnosis.kv_cache_saturation.entre"):
        Config.from_toml("[diagnosis.kv_cache_saturation]\nentre = 0.9\n")


def test_snapshot_with_garbage_values_degrades_not_crashes() -> None:
    t = TimelineBuilder().advance(40)
    snaps = t.snapshots
    snaps[-1].backends["vllm-0"]["kv_cache_usage"] = None
    snaps[-1].backends["vllm-0"]["ttft_seconds"] = Labelled({"le=1": 3.0})
    snaps[-1].gpus["0"]["memory_total_bytes"] = 0.0
    a = Analyzer(backends=t.backends())
    for s in snaps:
        a.observe(s)
    assert dataclasses.is_dataclass(a.config)

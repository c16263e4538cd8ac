"""The contracts the analysis cost work relies on: ``Sample`` behaves as the frozen dataclass it
replaced, ``Snapshot.extend`` places samples as one ``add`` each does, and the analyzer records
only the history its rules declare, with a read of anything else failing loudly."""

from __future__ import annotations

import copy
import logging
import pickle
import random

import pytest

from llmdiag.analyzers import Analyzer
from llmdiag.analyzers import context
from llmdiag.analyzers.context import UndeclaredHistory, history_name
from llmdiag.analyzers.rules import RULES
from llmdiag.analyzers.rules.base import reads
from llmdiag.analyzers.rules.availability import BackendDown, EngineStalled
from llmdiag.analyzers.rules.engine import QueueAvalanche
from llmdiag.analyzers.timelines import SCENARIOS
from llmdiag.config.analyzers import DiagnosisConfig
from llmdiag.model import Distribution, Labelled, Sample, Scope, Snapshot


def test_sample_is_an_immutable_value() -> None:
    a = Sample(Scope.ENGINE, "vllm-0", "kv_cache_usage", 0.5, engine="1")
    b = Sample(Scope.ENGINE, "vllm-0", "kv_cache_usage", 0.5, "1")
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != Sample(Scope.ENGINE, "vllm-0", "kv_cache_usage", 0.6, engine="1")
    assert a != ("engine", "vllm-0", "kv_cache_usage", 0.5, "1")
    assert (a.scope, a.subject, a.name, a.value, a.engine) == (Scope.ENGINE, "vllm-0", "kv_cache_usage", 0.5, "1")
    assert repr(a) == "Sample(scope=<Scope.ENGINE: 'engine'>, subject='vllm-0', name='kv_cache_usage', value=0.5, engine='1')"
    for attempt in (lambda: setattr(a, "value", 1.0), lambda: delattr(a, "name"), lambda: setattr(a, "other", 1)):
        with pytest.raises(AttributeError):
            attempt()
    assert pickle.loads(pickle.dumps(a)) == a and copy.deepcopy(a) == a and copy.copy(a) == a
    assert Sample(Scope.HOST, "", "psi_io_full_avg10", 0.1).engine is None
    match a:
        case Sample(Scope.ENGINE, subject, name, value, engine):
            assert (subject, name, value, engine) == ("vllm-0", "kv_cache_usage", 0.5, "1")
        case _:
            pytest.fail("no positional match")


@pytest.mark.parametrize(("args", "kwargs", "message"), [
    ((Scope.BACKEND, "a", "engines", 1), {}, "reserved key"),
    ((Scope.HOST, "", "destinations", 1), {}, "reserved key"),
    ((Scope.ENGINE, "a", "kv_cache_usage", 1), {}, "engine label"),
    ((Scope.BACKEND, "a", "kv_cache_usage", 1), {"engine": "0"}, "engine label"),
])
def test_sample_validation(args: tuple, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Sample(*args, **kwargs)


def _samples() -> list[Sample]:
    """Every scope, runs of one subject broken up and resumed, repeated signals (the later wins)."""
    return [
        Sample(Scope.HOST, "", "psi_io_full_avg10", 0.02),
        Sample(Scope.BACKEND, "vllm-0", "requests_waiting", 3),
        Sample(Scope.BACKEND, "vllm-0", "ttft_seconds", Distribution(0.3, 2.4, 0.5, 10)),
        Sample(Scope.ENGINE, "vllm-0", "kv_cache_usage", 0.9, engine="0"),
        Sample(Scope.ENGINE, "vllm-0", "kv_cache_usage", 0.4, engine="1"),
        Sample(Scope.ENGINE, "vllm-0", "requests_waiting", 2, engine="0"),
        Sample(Scope.BACKEND, "vllm-1", "requests_waiting", 1),
        Sample(Scope.BACKEND, "vllm-0", "requests_waiting", 4),
        Sample(Scope.DESTINATION, "10.0.0.7:8000", "timewait_sockets", 800),
        Sample(Scope.DESTINATION, "10.0.0.8:8000", "timewait_sockets", 20),
        Sample(Scope.GPU, "0", "gpu_utilization", 0.93),
        Sample(Scope.GPU, "1", "gpu_utilization", 0.1),
        Sample(Scope.GPU, "0", "memory_used_bytes", 7.0),
        Sample(Scope.HOST, "", "psi_io_full_avg10", 0.05),
        Sample(Scope.BACKEND, "vllm-1", "h2_rst_stream_total", Labelled({"code=CANCEL": 3.0})),
        Sample(Scope.ENGINE, "vllm-2", "requests_running", 1, engine="0"),
    ]


def test_extend_places_samples_as_one_add_each() -> None:
    rng = random.Random(7)
    for _ in range(20):
        samples = _samples()
        rng.shuffle(samples)
        one_by_one = Snapshot(ts=1.0)
        for s in samples:
            one_by_one.add(s)
        extended = Snapshot(ts=1.0)
        extended.extend(samples[:5])
        extended.extend(iter(samples[5:]))
        assert extended == one_by_one
        assert extended.dumps() == one_by_one.dumps()
        assert list(extended.samples()) == list(one_by_one.samples())


def test_history_names() -> None:
    assert reads("be", "up", "ttft_seconds.ewma") == {"b/up", "e/up", "b/ttft_seconds.ewma", "e/ttft_seconds.ewma"}
    assert history_name("ttft_seconds.ewma") == "ttft_seconds"
    assert history_name("responses_total{class=ok}") == "responses_total"
    assert history_name("xid_errors_total{gpu=0,xid=79.1}") == "xid_errors_total"
    assert history_name("up") == "up"


def test_only_declared_history_is_recorded() -> None:
    analyzer = Analyzer(DiagnosisConfig())
    assert analyzer.history == frozenset().union(*(cls.history for cls in RULES.values()))
    timeline = SCENARIOS["timewait_exhaustion"].build()
    assert timeline.snapshots[-1].destinations
    for snap in timeline.snapshots:
        analyzer.observe(snap)
    keys = list(analyzer.windows._series)
    assert keys, "nothing recorded"
    for key in keys:
        scope, signal = key.split("/", 1)[0], key.rsplit("/", 1)[-1]
        assert f"{scope}/{signal}" in analyzer.history or f"{scope}/{history_name(signal)}" in analyzer.history, key
    # Undeclared at that scope or field: not recorded (the timeline has both).
    assert not any(k.startswith("d/") for k in keys)
    assert any(k.endswith("/ttft_seconds.ewma") for k in keys) and not any(k.endswith("/ttft_seconds.p99") for k in keys)


def test_a_rule_reading_undeclared_history_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    # QueueAvalanche reads requests_waiting ten seconds ago; EngineStalled also declares it, so it
    # is recorded, but the check is per rule: dropping it from QueueAvalanche alone must fail.
    assert context.STRICT_HISTORY  # tests/conftest.py: LLMDIAG_STRICT_HISTORY=1
    monkeypatch.setattr(QueueAvalanche, "history", frozenset())
    analyzer = Analyzer(DiagnosisConfig())
    timeline = SCENARIOS["queue_avalanche"].build()
    with pytest.raises(UndeclaredHistory, match="requests_waiting"):
        for snap in timeline.snapshots:
            analyzer.observe(snap)


def test_outside_tests_an_undeclared_read_is_logged_once_and_recorded_from_then_on(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # The running agent: a rule path no test reached must not fail every tick.
    monkeypatch.setattr(context, "STRICT_HISTORY", False)
    for rule in (BackendDown, EngineStalled, QueueAvalanche):  # every rule that declares requests_waiting
        monkeypatch.setattr(rule, "history", frozenset(e for e in rule.history if not e.endswith("/requests_waiting")))
    analyzer = Analyzer(DiagnosisConfig())
    assert not any(e.endswith("/requests_waiting") for e in analyzer.history)
    timeline = SCENARIOS["queue_avalanche"].build()
    with caplog.at_level(logging.ERROR, logger="llmdiag.analyzers"):
        for snap in timeline.snapshots:
            analyzer.observe(snap)
    learned = [e for e in analyzer.history if e.endswith("/requests_waiting")]
    assert learned, analyzer.history
    assert any(k.endswith("/requests_waiting") for k in analyzer.windows._series)  # recorded since
    errors = [r for r in caplog.records if "does not declare" in r.getMessage()]
    assert len(errors) == 1 and "requests_waiting" in errors[0].getMessage()

"""Mutated scrapes (hypothesis) never make collect() raise and always give JSON-safe signals."""

from __future__ import annotations

import json

from engine_http import FIXTURES, SHARED_ENGINES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmdiag.collectors.engine import EngineCollector
from llmdiag.collectors.http_fetch import FetchResult
from llmdiag.model import Backend, CollectorState, CollectorStatus, Snapshot, encode_value

SCRAPES = [
    (SHARED_ENGINES / "vllm_v1_real_scrape_0.9era.prom").read_text(),
    (SHARED_ENGINES / "vllm_SYNTHETIC_current_v1_names_text0.0.4.prom").read_text(),
    (FIXTURES / "sglang_documented_text0.0.4.prom").read_text(),
    (FIXTURES / "trtllm_triton_documented.prom").read_text(),
    (FIXTURES / "tgi_documented.prom").read_text(),
]
ODD_VALUES = ["NaN", "+Inf", "-Inf", "-1", "1e308", "0", "abc", "", "1 2 3", "0x10"]


@st.composite
def mutated(draw) -> str:
    lines = draw(st.sampled_from(SCRAPES)).split("\n")
    for _ in range(draw(st.integers(0, 6))):
        if not lines:
            break
        i = draw(st.integers(0, len(lines) - 1))
        action = draw(st.sampled_from(["delete", "duplicate", "value", "truncate", "garbage", "label", "swap"]))
        line = lines[i]
        if action == "delete":
            del lines[i]
        elif action == "duplicate":
            lines.insert(i, line)
        elif action == "value" and " " in line:
            lines[i] = line.rsplit(" ", 1)[0] + " " + draw(st.sampled_from(ODD_VALUES))
        elif action == "truncate":
            lines[i] = line[: draw(st.integers(0, max(0, len(line))))]
        elif action == "garbage":
            lines[i] = draw(st.text(max_size=40))
        elif action == "label":
            lines[i] = line.replace('="', '="a,b=c', 1)
        elif action == "swap":
            j = draw(st.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], line
    return "\n".join(lines)


def _check(collector: EngineCollector, now: float) -> None:
    snap = Snapshot(ts=now)
    snap.extend(collector.collect(now))
    json.dumps(snap.to_json(), allow_nan=False)  # every value encodes (NaN/Inf -> null)
    for signals in snap.backends.values():
        for value in signals.values():
            encode_value(value)
    assert isinstance(collector.status(), CollectorStatus)
    for result in collector.results.values():  # bad input is a problem report, never an internal error
        assert not (result.error or "").startswith("could not read the scrape"), result.error


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(mutated(), min_size=1, max_size=3))
def test_mutated_scrape_sequences_never_raise(bodies):
    queue = list(bodies)

    def fetch(url, timeout, max_bytes, accept):
        return FetchResult(url, 200, queue.pop(0) if len(queue) > 1 else queue[0])

    collector = EngineCollector([Backend.from_url("http://127.0.0.1:1", name="b")], fetch=fetch)
    for i in range(len(bodies)):
        _check(collector, float(i))
    collector.close()


@settings(max_examples=30, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_never_raise(data):
    def fetch(url, timeout, max_bytes, accept):
        return FetchResult(url, 200, data.decode("utf-8", errors="replace"))

    collector = EngineCollector([Backend.from_url("http://127.0.0.1:1", name="b")], fetch=fetch)
    _check(collector, 0.0)
    collector.close()


def test_a_fetch_that_raises_is_contained():
    def fetch(url, timeout, max_bytes, accept):
        raise RuntimeError("boom")

    collector = EngineCollector([Backend.from_url("http://127.0.0.1:1", name="b")], fetch=fetch)
    samples = collector.collect(0.0)
    assert [s.value for s in samples if s.name == "up"] == [0]
    assert collector.status().status is CollectorState.DEGRADED and "boom" in collector.status().reason

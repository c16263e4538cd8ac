"""SampleReuse: a subject's samples are built once while its signals repeat, and never reused across a change."""

from __future__ import annotations

from llmdiag.collectors.sample_reuse import SampleReuse
from llmdiag.model import Labelled, Sample, Scope


def build_counting(builds: list[str], subject: str, signals: dict):  # noqa: ANN201
    def build() -> list[Sample]:
        builds.append(subject)
        return [Sample(Scope.BACKEND, subject, name, value) for name, value in signals.items()]
    return build


def test_repeated_signals_reuse_the_samples_and_any_change_builds_them_again() -> None:
    reuse = SampleReuse()
    builds: list[str] = []
    ticks = [
        {"a": 1, "b": 2.5},
        {"a": 1, "b": 2.5},  # the same: reused
        {"a": 1, "b": 2.6},  # a value moved
        {"a": 1.0, "b": 2.6},  # equal, but now a float: JSON would print it differently
        {"b": 2.6, "a": 1.0},  # the same values in another order
        {"a": 1.0},  # a signal gone
        {"a": float("nan")},
        {"a": float("nan")},  # NaN is never equal to itself: built again
    ]
    got = []
    for signals in ticks:
        got.append(reuse.samples("vllm-0", signals, build_counting(builds, "vllm-0", signals)))
        reuse.next_tick()
    assert len(builds) == len(ticks) - 1  # only the second tick was reused
    assert got[1] is got[0]
    for signals, samples in zip(ticks, got, strict=True):
        assert [(s.name, repr(s.value)) for s in samples] == [(k, repr(v)) for k, v in signals.items()]


def test_a_subject_not_seen_for_a_tick_is_forgotten_and_labelled_values_are_never_shared() -> None:
    reuse = SampleReuse()
    builds: list[str] = []
    one = {"x": 3}
    reuse.samples("k", one, build_counting(builds, "k", one))
    reuse.next_tick()
    reuse.next_tick()  # a tick without "k"
    reuse.samples("k", one, build_counting(builds, "k", one))
    assert builds == ["k", "k"]
    labelled = {"reasons": Labelled({"reason=stop": 1.0})}
    first = reuse.samples("l", labelled, build_counting(builds, "l", labelled))
    reuse.next_tick()
    second = reuse.samples("l", labelled, build_counting(builds, "l", labelled))
    assert first is not second and builds[-2:] == ["l", "l"]

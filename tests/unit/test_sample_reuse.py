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


def test_each_builds_what_the_plain_comprehension_builds_and_keeps_only_samples_that_repeat() -> None:
    reuse = SampleReuse()
    subjects = [(Scope.BACKEND, "a"), (Scope.DESTINATION, "*:8000")]
    ticks = [
        {"x": 1, "y": 2.5, "z": None},
        {"x": 1, "y": 2.5, "z": None},  # all the same: every Sample is last tick's
        {"x": 2, "y": 2.5, "z": None},  # one moved: the others are kept
        {"x": 2.0, "y": 2.5, "z": None},  # equal, but a float now: built again
        {"y": 2.5, "x": 2.0, "z": None},  # another order: the plain order of this tick
        {"x": float("nan"), "y": 2.5},  # a signal gone
        {"x": float("nan"), "y": 2.5},  # NaN is never equal to itself
        {"x": Labelled({"k=v": 1.0}), "y": 2.5},
        {"x": Labelled({"k=v": 1.0}), "y": 2.5},  # a Labelled value is never shared
    ]
    got = []
    for signals in ticks:
        got.append(reuse.each(subjects, signals))
        reuse.next_tick()
    for signals, samples in zip(ticks, got, strict=True):
        plain = [Sample(scope, name, signal, value) for scope, name in subjects for signal, value in signals.items()]
        assert [(s.scope, s.subject, s.name, repr(s.value), type(s.value)) for s in samples] == \
            [(s.scope, s.subject, s.name, repr(s.value), type(s.value)) for s in plain]

    def same(t: int, i: int) -> bool:
        return got[t][i] is got[t - 1][i]
    assert all(same(1, i) for i in range(6))
    assert [same(2, i) for i in range(6)] == [False, True, True, False, True, True]
    assert [same(3, i) for i in range(6)] == [False, True, True, False, True, True]
    assert not same(6, 0) and same(6, 1)
    assert got[8][0] is not got[7][0] and same(8, 1)
    # A subject missing for a tick is forgotten.
    reuse.next_tick()
    assert reuse.each(subjects[:1], ticks[-1])[1] is not got[-1][1]

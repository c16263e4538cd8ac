"""SampleReuse: a subject's samples are built once while its signals repeat, and never reused across a change."""

from __future__ import annotations

from llmdiag.collectors.sample_reuse import SampleReuse
from llmdiag.model import Labelled, Sample, Scope


def test_a_subject_not_seen_for_a_tick_is_forgotten_and_labelled_values_are_never_shared() -> None:
    reuse = SampleReuse()
    subject = [(Scope.BACKEND, "k")]
    first = reuse.each(subject, {"x": 3})
    reuse.next_tick()
    assert reuse.each(subject, {"x": 3})[0] is first[0]  # seen last tick: kept
    reuse.next_tick()
    reuse.next_tick()  # a tick without "k"
    again = reuse.each(subject, {"x": 3})
    assert again[0] is not first[0] and again == first
    labelled = [(Scope.BACKEND, "l")]
    one = reuse.each(labelled, {"reasons": Labelled({"reason=stop": 1.0})})
    reuse.next_tick()
    two = reuse.each(labelled, {"reasons": Labelled({"reason=stop": 1.0})})
    assert one[0] is not two[0] and one[0].value is not two[0].value


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

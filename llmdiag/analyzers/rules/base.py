"""The rule contract: one small class per diagnosis kind.

A rule looks at one tick's :class:`~llmdiag.analyzers.context.Context` and
yields ``(subject, key, finding)`` for every subject it can judge: the
subject is a backend name or ``host``, the key tells apart several
diagnoses of one kind on one subject (a destination, a GPU index; usually
``""``). ``finding`` is ``None`` when the rule has no data for that subject
this tick (a scrape gap): the engine then neither opens nor closes it.

A :class:`Finding` carries two verdicts for hysteresis: ``enter`` (the
strict condition, which must hold ``for_seconds`` to open) and ``stay``
(the looser exit condition; the diagnosis closes when it fails, after
``hold_seconds``). A finding that stays without entering is *holding*: the
rule then gives the exit threshold in its evidence (:func:`bar` picks it),
and :meth:`Rule.finding` says "holding" in the summary, so that an open
diagnosis never shows a value under the threshold it seems to need.

:meth:`Rule.explained` makes the same finding with its summary and evidence
built by a function, only when the analyzer needs them (a diagnosis opens or
stays open): most subjects, most ticks, need neither.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import ClassVar, Generic, TypeVar

from llmdiag.analyzers.context import Context
from llmdiag.config.analyzers import RuleConfig
from llmdiag.model import Evidence, Severity

__all__ = ["Finding", "Rule", "Verdict", "bar", "ev", "reads"]

C = TypeVar("C", bound=RuleConfig)


class Finding:
    """One rule's verdict on one subject this tick: ``enter``/``stay`` for hysteresis, the severity,
    confidence and penalty, and the ``summary`` and ``evidence`` a person reads.

    The summary and evidence are only needed when a diagnosis opens or stays open, and most
    findings (a healthy backend, every tick) do neither, so a rule may hand over an ``explain``
    function instead, called at most once, the first time either is read. An ``explain`` may read
    the rule's loop variables: the analyzer reads a finding before it resumes the rule's
    generator (``Analyzer.observe``); a caller that keeps findings past that must read them first.
    """

    __slots__ = ("enter", "stay", "severity", "confidence", "penalty", "_summary", "_evidence", "_explain")

    def __init__(self, enter: bool, stay: bool, severity: Severity, summary: str, evidence: tuple[Evidence, ...],
                 confidence: float, penalty: float,
                 explain: Callable[[], tuple[str, tuple[Evidence, ...]]] | None = None) -> None:
        self.enter = enter
        self.stay = stay
        self.severity = severity
        self.confidence = confidence
        self.penalty = penalty
        self._summary = summary
        self._evidence = evidence
        self._explain = explain

    def _explained(self) -> None:
        explain, self._explain = self._explain, None
        if explain is not None:
            self._summary, self._evidence = explain()

    @property
    def summary(self) -> str:
        self._explained()
        return self._summary

    @property
    def evidence(self) -> tuple[Evidence, ...]:
        self._explained()
        return self._evidence

    def __repr__(self) -> str:
        return (f"Finding(enter={self.enter}, stay={self.stay}, severity={self.severity}, summary={self.summary!r}, "
                f"evidence={self.evidence!r}, confidence={self.confidence}, penalty={self.penalty})")


Verdict = tuple[str, str, Finding | None]


def reads(scopes: str, *signals: str) -> frozenset[str]:
    """``Rule.history`` entries: each signal at each scope letter of ``scopes`` (``b`` backend,
    ``e`` DP engine, ``g`` GPU, ``d`` destination, ``h`` host; :func:`~llmdiag.analyzers.windows.series_key`).
    A signal is a plain or labelled name (a labelled one declares every label and the sum),
    a distribution's name (all its fields) or one field of it (``ttft_seconds.ewma``)."""
    return frozenset(f"{scope}/{signal}" for scope in scopes for signal in signals)


class Rule(Generic[C]):
    kind: ClassVar[str]
    remediation: ClassVar[str]
    #: The window signals the rule reads history of (``ctx.rate``/``increase``/``ago``/``value_at``/
    #: ``outage``/``series``/``increments``), as ``scope/signal`` (see :func:`reads`). The analyzer
    #: records only what some enabled rule declares (most of a tick's ~1,300 numbers are never read
    #: back), and while a rule runs :class:`Context` raises :class:`UndeclaredHistory` on its read of
    #: anything it does not declare, so a missing entry fails every test that reaches the read.
    history: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, config: C) -> None:
        self.config = config

    def evaluate(self, ctx: Context) -> Iterable[Verdict]:
        raise NotImplementedError

    def finding(
        self,
        enter: bool,
        stay: bool,
        severity: Severity,
        summary: str,
        evidence: Iterable[Evidence],
        confidence: float,
        penalty: float | None = None,
    ) -> Finding:
        """A finding whose penalty follows the severity unless given (info defaults to 0)."""
        holding = bool(stay) and not enter
        if holding and "holding" not in summary:
            summary += _HOLDING
        return Finding(enter or False, stay or enter or False, severity, summary, tuple(evidence),
                       max(0.0, min(1.0, confidence)), self._penalty(severity, penalty))

    def explained(
        self,
        enter: bool,
        stay: bool,
        severity: Severity,
        explain: Callable[[], tuple[str, Iterable[Evidence]]],
        confidence: float,
        penalty: float | None = None,
    ) -> Finding:
        """:meth:`finding` with the summary and evidence from ``explain()``, called only if they are
        read (see :class:`Finding`): the same finding, without building text nobody reads."""
        holding = bool(stay) and not enter

        def resolve() -> tuple[str, tuple[Evidence, ...]]:
            summary, evidence = explain()
            if holding and "holding" not in summary:
                summary += _HOLDING
            return summary, tuple(evidence)

        return Finding(enter or False, stay or enter or False, severity, "", (), max(0.0, min(1.0, confidence)),
                       self._penalty(severity, penalty), resolve)

    def _penalty(self, severity: Severity, penalty: float | None) -> float:
        if penalty is None:
            # A branch, not a dict built per call: every rule makes a finding per subject per tick.
            if severity is Severity.CRITICAL:
                penalty = self.config.critical_penalty
            elif severity is Severity.WARNING:
                penalty = self.config.penalty
            elif severity is Severity.INFO:
                penalty = 0.0
            else:
                raise KeyError(severity)
        return max(0.0, min(1.0, penalty))


_HOLDING = " (holding: past the exit threshold, no longer the enter one)"


def bar(enter: bool, enter_threshold: float, exit_threshold: float) -> float:
    """The threshold the evidence shows: the enter one, or while holding (the enter condition
    no longer met) the exit one that keeps the diagnosis open."""
    return enter_threshold if enter else exit_threshold


def ev(signal: str, value: float | str | None, threshold: float | str | None, window: float | None) -> Evidence:
    """Evidence with numbers rounded for people (6 significant digits); ``window`` ``None``
    for a value read as it is now."""
    if isinstance(value, float):
        value = float(f"{value:.6g}")
    if isinstance(threshold, float):
        threshold = float(f"{threshold:.6g}")
    return Evidence(signal, value, threshold, None if window is None else float(f"{float(window):.6g}"))

"""``Rule.explained``: a finding's summary and evidence are built only when a diagnosis needs them,
from the values of the subject and tick they belong to."""

from __future__ import annotations

from collections.abc import Iterable

from llmdiag.analyzers import Analyzer
from llmdiag.analyzers.context import Context
from llmdiag.analyzers.rules.base import Rule, Verdict, ev
from llmdiag.analyzers.timelines import SCENARIOS
from llmdiag.config.analyzers import DiagnosisConfig, KvCacheSaturationConfig
from llmdiag.model import Evidence, Severity


class CountingKv(Rule[KvCacheSaturationConfig]):
    """kv_cache_usage >= enter opens, >= exit stays; counts its explain calls (subject, ts)."""

    kind = "kv_cache_saturation"
    remediation = "test"

    def __init__(self, config: KvCacheSaturationConfig) -> None:
        super().__init__(config)
        self.explained_for: list[tuple[str, float]] = []

    def evaluate(self, ctx: Context) -> Iterable[Verdict]:
        for b in ctx.backends:
            usage = ctx.backend(b, "kv_cache_usage")
            if usage is None:
                yield b, "", None
                continue

            # Reads the loop's variables: valid while the analyzer handles this verdict.
            def explain() -> tuple[str, list[Evidence]]:
                self.explained_for.append((b, ctx.now))
                return f"{b} at {usage:.2f}", [ev("kv_cache_usage", usage, self.config.enter, None)]

            yield b, "", self.explained(usage >= self.config.enter, usage >= self.config.exit, Severity.WARNING,
                                        explain, 0.9)


def test_explain_runs_only_for_open_diagnoses_with_their_own_subject() -> None:
    timeline = SCENARIOS["kv_cache_saturation"].build()
    analyzer = Analyzer(DiagnosisConfig(), backends=timeline.backends())
    rule = CountingKv(analyzer.config.rule("kv_cache_saturation"))  # type: ignore[arg-type]
    analyzer.rules = [rule]
    needed: list[tuple[str, float]] = []
    for snap in timeline.snapshots:
        result = analyzer.observe(snap)
        # A diagnosis is (re)built on the tick it opens and on every tick it stays open.
        needed += [(d.backend, snap.ts) for d in result.open]
        for d in result.open:
            usage = snap.backends[d.backend]["kv_cache_usage"]
            assert d.summary.startswith(f"{d.backend} at {usage:.2f}"), d.summary
            assert d.evidence[0].value == usage
    assert needed, "the scenario opens a diagnosis"
    # Never for the healthy backend, never while pending: exactly once per open diagnosis and tick.
    assert rule.explained_for == needed
    assert len(timeline.snapshots) * len(timeline.backends()) > 3 * len(needed)


def test_a_holding_finding_says_so_in_its_lazy_summary() -> None:
    rule = CountingKv(KvCacheSaturationConfig())
    finding = rule.explained(False, True, Severity.WARNING, lambda: ("KV 82%", [ev("kv", 0.82, 0.8, None)]), 0.9)
    assert finding.summary == "KV 82% (holding: past the exit threshold, no longer the enter one)"
    assert finding.evidence == (Evidence("kv", 0.82, 0.8, None),)
    assert (finding.enter, finding.stay, finding.penalty) == (False, True, KvCacheSaturationConfig().penalty)

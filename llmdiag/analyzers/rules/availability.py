"""Availability: a backend that stopped answering (``backend_down``).

Every other rule goes quiet for a backend whose scrape failed (no data is not
evidence of overload), so without this rule an engine that died would be
reported healthy. This one reads exactly that gap: the engine collector's
``up`` = 0 and its ``scrape_failure{reason}``, and, from the analyzer's
windows, what the backend looked like the last time it answered.
"""

from __future__ import annotations

from collections.abc import Iterable

from llmdiag.analyzers.context import Context
from llmdiag.analyzers.rules.base import Rule, Verdict, ev
from llmdiag.config.analyzers import BackendDownConfig
from llmdiag.model import Evidence, Labelled, Severity

__all__ = ["FAILURE_TEXT", "BackendDown"]

#: How the summary names each ``scrape_failure`` reason (the engine collector's SCRAPE_FAILURES).
FAILURE_TEXT = {
    "connection_refused": "refuses connections",
    "timeout": "does not answer its scrape in time",
    "name_not_resolved": "has a host name that does not resolve",
    "unreachable": "is unreachable",
    "not_an_engine": "answers, but not as an inference engine",
    "http_error": "answers its scrape with an HTTP error",
    "bad_response": "answers, but not in HTTP",
    "too_large": "answers with more than the size cap",
    "bad_url": "has a URL llmdiag cannot scrape",
    "error": "cannot be scraped",
}

#: Gauges quoted as they were at the last good scrape: (signal, how the summary shows it).
_LAST_GAUGES = (
    ("kv_cache_usage", lambda v: f"KV {v:.0%}"),
    ("requests_waiting", lambda v: f"{v:g} waiting"),
    ("ttft_seconds.ewma", lambda v: f"TTFT {v:.2f}s"),
)
#: Counters whose increase before (and during) the outage is quoted.
_LAST_COUNTERS = (
    ("cuda_alloc_failures_total", "allocation failures"),
    ("allocator_ooms_total", "OOMs"),
    ("allocator_alloc_retries_total", "allocator retries"),
    ("preemptions_total", "preemptions"),
)


class BackendDown(Rule[BackendDownConfig]):
    """The backend's scrapes fail (``up`` = 0) for ``for_seconds``: refused, timing out, not
    resolving, or answering as something other than an engine (HTML, 404).

    Always critical with penalty 1 (``critical_penalty``): the balancer reads a
    ``backend_down`` reason as an ejection. Closes once every scrape has answered for
    ``recover_seconds`` (and the diagnosis has been open ``hold_seconds``). The evidence says
    which failure, since when, and what was last seen before it went: KV usage, queue, TTFT
    EWMA and GPU memory at the last good scrape, and allocation failures, OOMs, allocator
    retries and preemptions within ``lookback_seconds``.
    """

    kind = "backend_down"
    remediation = (
        "Eject it from routing; check the engine process (crash, OOM kill, restart loop) and its logs. "
        "It is re-admitted once it answers again."
    )

    def evaluate(self, ctx: Context) -> Iterable[Verdict]:
        cfg = self.config
        for b in ctx.backends:
            up = ctx.up(b)
            if up is None:
                yield b, "", None  # no engine scrape for this backend (gRPC, engine collector off)
                continue
            down_since, last_up, last_down = ctx.outage(b)
            if up:
                # Answering again: hold until it has answered every scrape for recover_seconds.
                holding = last_down is not None and ctx.now - last_down < cfg.recover_seconds
                if not holding:
                    yield b, "", self.finding(False, False, Severity.CRITICAL, "answering", (), 1.0)
                    continue
                up_for = ctx.now - last_down
                evidence = [ev("up", 1.0, f"1 for {cfg.recover_seconds:g}s", up_for)]
                summary = f"answering again for {_secs(up_for)} (holding until {cfg.recover_seconds:g}s without a failed scrape)"
                yield b, "", self.finding(False, True, Severity.CRITICAL, summary, evidence, 0.9)
                continue
            failure = _failure(ctx.snapshot.backends.get(b, {}).get("scrape_failure"))
            since = down_since if down_since is not None else ctx.now
            down_for = ctx.now - since
            evidence = [ev("up", 0.0, 1.0, down_for), ev("scrape_failure", failure, None, None)]
            seen = self._last_seen(ctx, b, last_up)
            evidence.extend(seen[0])
            what = FAILURE_TEXT.get(failure, "cannot be scraped")
            summary = f"{what} ({failure}) for {_secs(down_for)}"
            if last_up is None:
                summary += "; never answered within the window"
            else:
                summary += f"; last answered {_secs(ctx.now - last_up)} ago"
                if seen[1]:
                    summary += " with " + ", ".join(seen[1])
            yield b, "", self.finding(True, True, Severity.CRITICAL, summary, evidence, 0.95)

    def _last_seen(self, ctx: Context, b: str, last_up: float | None) -> tuple[list[Evidence], list[str]]:
        """Evidence and summary phrases for what the backend looked like before it went."""
        evidence: list[Evidence] = []
        phrases: list[str] = []
        if last_up is not None:
            for signal, show in _LAST_GAUGES:
                value = ctx.value_at("b", b, signal, last_up)
                if value is not None:
                    evidence.append(ev(f"{signal} (last seen)", value, None, None))
                    phrases.append(show(value))
            worst = None
            for g in ctx.gpus_for(b):
                used = ctx.value_at("g", g, "memory_used_bytes", last_up)
                total = ctx.value_at("g", g, "memory_total_bytes", last_up)
                if used is not None and total:
                    if worst is None or used / total > worst[1]:
                        worst = (g, used / total)
            if worst is not None:
                evidence.append(ev(f"gpus[{worst[0]}].memory_used_bytes / memory_total_bytes (last seen)", worst[1], None, None))
                phrases.append(f"GPU memory {worst[1]:.0%}")
        lookback = self.config.lookback_seconds
        for signal, label in _LAST_COUNTERS:
            inc = ctx.increase("b", b, signal, lookback)
            if inc is not None:
                evidence.append(ev(f"{signal} (increase)", inc, None, lookback))
                if inc > 0:
                    phrases.append(f"{inc:g} {label} in the last {lookback:g}s")
        return evidence, phrases


def _secs(seconds: float) -> str:
    """Seconds as a person reads them: ``12s``, ``1.5s``."""
    return f"{seconds:.0f}s" if seconds >= 10 else f"{seconds:.1f}".rstrip("0").rstrip(".") + "s"


def _failure(value: object) -> str:
    """The reason in ``scrape_failure{reason}`` (``unknown`` from a recording without it)."""
    if isinstance(value, Labelled):
        for key, v in value.items():
            if v and key.startswith("reason="):
                return key.partition("=")[2]
    return "unknown"

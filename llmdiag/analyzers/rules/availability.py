"""Availability: a backend that stopped answering (``backend_down``), or that answers and
produces nothing (``engine_stalled``).

Every other rule goes quiet for a backend whose scrape failed (no data is not
evidence of overload), so without this rule an engine that died would be
reported healthy. This one reads exactly that gap: the engine collector's
``up`` = 0 and its ``scrape_failure{reason}``, and, from the analyzer's
windows, what the backend looked like the last time it answered.
"""

from __future__ import annotations

from collections.abc import Iterable

from llmdiag.analyzers.context import Context
from llmdiag.analyzers.rules.base import Rule, Verdict, ev, reads
from llmdiag.config.analyzers import BackendDownConfig, EngineStalledConfig
from llmdiag.model import Evidence, Labelled, Severity

__all__ = ["FAILURE_TEXT", "BackendDown", "EngineStalled"]

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
    """The backend's scrapes fail (``up`` = 0): refused, timing out, not resolving, or
    answering as something other than an engine (HTML, 404). It opens once the engine has gone
    unanswered for ``unanswered_seconds`` since its last good scrape (a hung scrape counts its
    whole deadline), or at the first refused connection (``open_on_refused``).

    Always critical with penalty 1 (``critical_penalty``): the balancer reads a
    ``backend_down`` reason as an ejection. Closes once every scrape has answered for
    ``recover_seconds`` (and the diagnosis has been open ``hold_seconds``). The evidence says
    which failure, since when, and what was last seen before it went: KV usage, queue, TTFT
    EWMA and GPU memory at the last good scrape, and allocation failures, OOMs, allocator
    retries and preemptions within ``lookback_seconds``.
    """

    kind = "backend_down"
    history = (reads("b", "up", *(s for s, _ in _LAST_GAUGES), *(s for s, _ in _LAST_COUNTERS))
               | reads("g", "memory_used_bytes", "memory_total_bytes"))
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
            unanswered = _unanswered(ctx, b, last_up, down_for)
            enter = unanswered >= cfg.unanswered_seconds or (cfg.open_on_refused and failure == "connection_refused")
            evidence = [
                ev("up", 0.0, 1.0, down_for or None),  # failed scrapes over this long; None at the first
                ev("scrape_failure", failure, None, None),
                ev("unanswered_seconds", unanswered, "refused" if failure == "connection_refused" and cfg.open_on_refused else cfg.unanswered_seconds, None),
            ]
            seen = self._last_seen(ctx, b, last_up)
            evidence.extend(seen[0])
            what = FAILURE_TEXT.get(failure, "cannot be scraped")
            summary = f"{what} ({failure}), unanswered for {_secs(unanswered)}"
            if last_up is None:
                summary += "; never answered within the window"
            else:
                summary += f"; last answered {_secs(ctx.now - last_up)} ago"
                if seen[1]:
                    summary += " with " + ", ".join(seen[1])
            if not enter:
                # Under the bar to open, but a backend that does not answer never counts as back:
                # an open diagnosis stays open (holding) through a short failure.
                summary += f" (holding: opens at {cfg.unanswered_seconds:g}s unanswered, stays open while it does not answer)"
            yield b, "", self.finding(enter, True, Severity.CRITICAL, summary, evidence, 0.95)

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


#: The engine's step counter (vLLM's ``iteration_tokens_total`` observations): a rule input only
#: where the engine counts per step. SGLang and TGI count their tokens when a request ends, so a
#: long generation would look like a stall there; they are not judged.
_STEPS = "engine_steps_total"
#: Counters that move whenever the engine does work: steps, prefill and decode tokens. (Finished
#: requests are not progress: a client that gives up on a hung engine "finishes" as an abort.)
_PROGRESS = (_STEPS, "generation_tokens_total", "prompt_tokens_total")


class EngineStalled(Rule[EngineStalledConfig]):
    """Requests running or waiting, and no engine step and no prompt or generation token for
    ``stalled_seconds``: the engine answers its scrapes and makes no progress (a hung NCCL
    collective, a deadlocked scheduler, a wedged GPU). ``up`` stays 1, the queue may not grow
    at light traffic, and TTFT is only measured once a first token comes, so no other rule
    sees it soon.

    Judged per data-parallel engine where the engine reports its own token counters (one
    stalled engine of four still moves the backend's sums), else on the backend. Critical,
    penalty 1 (``critical_penalty``). Closes at the first progress, after ``hold_seconds``.
    No data (``None``) for an engine whose scrape failed (that is ``backend_down``) or that
    does not count its steps (``engine_steps_total``: vLLM does; SGLang, TGI, Triton do not).
    """

    kind = "engine_stalled"
    history = reads("be", "requests_running", "requests_waiting", *_PROGRESS)
    remediation = (
        "Stop routing to it; look for a hung collective (NCCL), an XID or a stuck scheduler in the "
        "engine's logs and py-spy dump; restart the engine if it does not recover."
    )

    def evaluate(self, ctx: Context) -> Iterable[Verdict]:
        cfg = self.config
        for b in ctx.backends:
            if ctx.up(b) is not True:
                yield b, "", None
                continue
            judged = [(label, _stall(ctx, "e", f"{b}/{label}")) for label, _ in ctx.engines(b, "requests_running")]
            judged = [(label, j) for label, j in judged if j is not None] or [("", _stall(ctx, "b", b))]
            label, worst = max(judged, key=lambda x: -1.0 if x[1] is None else x[1][0])
            if worst is None:
                yield b, "", None
                continue
            stalled_for, running, waiting = worst
            enter = stalled_for >= cfg.stalled_seconds
            stay = stalled_for > 0
            where = f"engine {label}: " if label else ""
            prefix = f"engines[{label}]." if label else ""

            def explain() -> tuple[str, list[Evidence]]:
                evidence = [
                    ev(f"{prefix}requests_running", running, None, None),
                    ev(f"{prefix}requests_waiting", waiting, None, None),
                    ev(f"{prefix}engine_steps_total + prompt and generation tokens (increase)", 0.0, 0.0, stalled_for or None),
                    ev("stalled_seconds", stalled_for, cfg.stalled_seconds, None),
                ]
                summary = (
                    f"{where}no engine step and no token for {_secs(stalled_for)} "
                    f"with {running:g} running and {waiting:g} waiting"
                )
                return summary, evidence

            yield b, "", self.explained(enter, stay, Severity.CRITICAL, explain, 0.9)


def _stall(ctx: Context, scope: str, subject: str) -> tuple[float, float, float] | None:
    """``(seconds without progress while work was present, running, waiting)`` for one engine or
    backend now; 0 seconds when it progressed at the last tick or holds no work; ``None``
    without a step counter or a running gauge."""
    running_s = ctx.series(scope, subject, "requests_running")
    if running_s is None or not len(running_s):
        return None
    steps = ctx.series(scope, subject, _STEPS)
    if steps is None or len(steps) < 2:
        return None
    progress = [ctx.series(scope, subject, c) for c in _PROGRESS]
    progress = [p for p in progress if p is not None and len(p) >= 2]
    running = running_s.values[-1]
    waiting_s = ctx.series(scope, subject, "requests_waiting")
    waiting = waiting_s.values[-1] if waiting_s is not None and len(waiting_s) else 0.0
    if running + waiting <= 0:
        return 0.0, running, waiting
    # The last point where any progress counter changed (a rise, or a reset to a new process).
    since = max(_last_change(p) for p in progress)
    # ... or, after it, the last point where the engine held no work (idle is not stalled).
    for i in range(len(running_s.ts) - 1, running_s.start - 1, -1):
        ts = running_s.ts[i]
        if ts <= since:
            break
        w = waiting_s.at(ts) if waiting_s is not None else 0.0
        if running_s.values[i] <= 0 and not w:
            since = ts
            break
    return max(0.0, ctx.now - since), running, waiting


def _last_change(series) -> float:
    """The timestamp of the newest point that differs from the one before it (the oldest point
    when none does within the window)."""
    ts, values = series.ts, series.values
    for i in range(len(ts) - 1, series.start, -1):
        if values[i] != values[i - 1]:
            return ts[i]
    return ts[series.start]


def _unanswered(ctx: Context, b: str, last_up: float | None, down_for: float) -> float:
    """Seconds since the engine last answered a scrape. The engine collector measures it
    (``scrape_age_seconds`` on a failed scrape, which includes a hung scrape's whole deadline);
    without it (a recording, a timeline) it is the time since the last answered scrape in the
    window, and for an engine that never answered, since the first failed one."""
    age = ctx.backend(b, "scrape_age_seconds")
    if isinstance(age, (int, float)) and age >= 0:
        return float(age)
    if last_up is not None:
        return ctx.now - last_up
    return down_for


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

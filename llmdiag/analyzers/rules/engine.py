"""Engine-side rules: KV cache, queue, /health that lies, error bursts."""

from __future__ import annotations

from collections.abc import Iterable

from llmdiag.analyzers.context import Context
from llmdiag.analyzers.rules.base import Rule, Verdict, bar, ev, reads
from llmdiag.config.analyzers import (
    ErrorBurstConfig,
    FalseHealthyConfig,
    KvCacheSaturationConfig,
    QueueAvalancheConfig,
)
from llmdiag.model import Evidence, Severity

__all__ = [
    "CLIENT_REASONS",
    "SUCCESS_REASONS",
    "ErrorBurst",
    "FalseHealthy",
    "KvCacheSaturation",
    "QueueAvalanche",
    "finished_reason_class",
]


class KvCacheSaturation(Rule[KvCacheSaturationConfig]):
    """kv_cache_usage (from the engine) >= enter for for_seconds, or preemptions rising.

    Severity grows with harm: *info* (small penalty) when the cache is merely
    full but nothing waits and nothing is preempted (a well-packed engine is
    close to the edge: the next long prompt will preempt), *warning* when
    requests wait or preemptions rise, *critical* when preemptions rise with
    the cache at critical_usage. NVML memory never enters this rule: vLLM
    preallocates ``gpu_memory_utilization`` of the device, so NVML reads ~90 %
    on an idle engine.
    """

    kind = "kv_cache_saturation"
    history = reads("be", "preemptions_total")
    remediation = "Route long prompts elsewhere; lower max_num_seqs (or max_num_batched_tokens); scale out."

    def evaluate(self, ctx: Context) -> Iterable[Verdict]:
        cfg = self.config
        for b in ctx.backends:
            if ctx.up(b) is False:
                yield b, "", None
                continue
            kv = ctx.worst(b, "kv_cache_usage")
            preempted = ctx.increase("b", b, "preemptions_total", cfg.preemption_window_seconds)
            for label, _ in ctx.engines(b, "requests_waiting"):
                inc = ctx.increase("e", f"{b}/{label}", "preemptions_total", cfg.preemption_window_seconds)
                if inc is not None:
                    preempted = max(preempted or 0.0, inc)
            if kv is None and preempted is None:
                yield b, "", None
                continue
            kv_name, usage = kv if kv is not None else ("kv_cache_usage", None)
            preempting = bool(preempted)
            waiting = ctx.worst(b, "requests_waiting")
            queued = waiting is not None and waiting[1] > 0
            enter = (usage is not None and usage >= cfg.enter) or preempting
            stay = (usage is not None and usage >= cfg.exit) or preempting
            penalty = None
            if preempting and usage is not None and usage >= cfg.critical_usage:
                severity = Severity.CRITICAL
            elif preempting or queued:
                severity = Severity.WARNING
            else:
                severity, penalty = Severity.INFO, cfg.info_penalty

            def explain() -> tuple[str, list[Evidence]]:
                evidence = []
                if usage is not None:
                    evidence.append(ev(kv_name, usage, bar(enter, cfg.enter, cfg.exit), cfg.for_seconds))
                if preempted is not None:
                    evidence.append(ev("preemptions_total (increase)", preempted, 0.0, cfg.preemption_window_seconds))
                if waiting is not None:
                    evidence.append(ev(waiting[0], waiting[1], 0.0, None))
                pct = "n/a" if usage is None else f"{usage:.0%}"
                what = f"KV cache {pct} full" + (f", {preempted:g} preemptions in {cfg.preemption_window_seconds:g}s" if preempting else "")
                if queued:
                    what += f", {waiting[1]:g} waiting"
                return what, evidence

            confidence = 0.9 if (preempting and usage is not None and usage >= cfg.enter) else 0.7
            yield b, "", self.explained(enter, stay, severity, explain, confidence, penalty)


class QueueAvalanche(Rule[QueueAvalancheConfig]):
    """Waiting rising and TTFT EWMA >= ttft_ratio_enter x the backend's own baseline, or waiting >= waiting_enter.

    Checked on the backend aggregate and on each DP engine (one engine can
    drown while the average looks fine).
    """

    kind = "queue_avalanche"
    history = reads("be", "requests_waiting")
    remediation = "Shed or re-route new requests; check for a burst of long-context prompts."

    def evaluate(self, ctx: Context) -> Iterable[Verdict]:
        cfg = self.config
        for b in ctx.backends:
            ttft, base = ctx.ttft(b)
            if ctx.up(b) is False:
                yield b, "", None
                continue
            ratio = ttft / base if (ttft is not None and base) else None
            slow_enter = ratio is not None and ratio >= cfg.ttft_ratio_enter and ttft >= cfg.ttft_floor_seconds
            slow_stay = ratio is not None and ratio >= cfg.ttft_ratio_exit and ttft >= cfg.ttft_floor_seconds
            units: list[tuple[str, float, float | None]] = []
            w = ctx.backend(b, "requests_waiting")
            if w is not None:
                units.append(("requests_waiting", w, ctx.ago("b", b, "requests_waiting", cfg.rise_window_seconds)))
            for label, ew in ctx.engines(b, "requests_waiting"):
                ago = ctx.ago("e", f"{b}/{label}", "requests_waiting", cfg.rise_window_seconds)
                units.append((f"engines[{label}].requests_waiting", ew, ago))
            if not units:
                yield b, "", None
                continue
            enter = stay = False
            worst = max(units, key=lambda u: u[1])
            rising_unit = None
            for name, waiting, ago in units:
                rising = ago is not None and waiting > ago
                if waiting >= cfg.waiting_enter or (rising and waiting > 0 and slow_enter):
                    enter = True
                    if rising:
                        rising_unit = (name, waiting, ago)
                if waiting >= cfg.waiting_exit or (waiting > 0 and slow_stay):
                    stay = True

            def explain() -> tuple[str, list[Evidence]]:
                evidence = [ev(worst[0], worst[1], bar(enter, cfg.waiting_enter, cfg.waiting_exit), None)]
                if rising_unit is not None:
                    evidence.append(ev(f"{rising_unit[0]} {cfg.rise_window_seconds:g}s ago", rising_unit[2], "< now", cfg.rise_window_seconds))
                if ttft is not None:
                    ttft_bar = None if base is None else base * bar(enter, cfg.ttft_ratio_enter, cfg.ttft_ratio_exit)
                    evidence.append(ev("ttft_seconds.ewma", ttft, ttft_bar if ttft_bar is not None else "baseline warming up", ctx.config.baseline_seconds))
                summary = f"{worst[1]:g} requests waiting"
                if ratio is not None:
                    summary += f", TTFT {ttft:.2f}s = {ratio:.1f}x its baseline"
                return summary, evidence

            critical = worst[1] >= cfg.critical_factor * cfg.waiting_enter or (
                ratio is not None and ratio >= 2 * cfg.ttft_ratio_enter and slow_enter
            )
            severity = Severity.CRITICAL if critical else Severity.WARNING
            confidence = 0.9 if (slow_enter and worst[1] > 0) else 0.75
            yield b, "", self.explained(enter, stay, severity, explain, confidence)


class FalseHealthy(Rule[FalseHealthyConfig]):
    """The engine answers (``up`` = 1) but its TTFT EWMA >= ttft_enter_seconds while its peers' median is normal."""

    kind = "false_healthy"
    remediation = "Stop trusting /health for this backend; route by score (TTFT, queue) instead."

    def evaluate(self, ctx: Context) -> Iterable[Verdict]:
        cfg = self.config
        ttfts: dict[str, float] = {}
        for b in ctx.backends:
            t = ctx.dist(b, "ttft_seconds", "ewma")
            if t is not None and ctx.up(b):
                ttfts[b] = t
        for b in ctx.backends:
            ttft = ttfts.get(b)
            peers = ctx.peers_median(b, ttfts)
            if ttft is None or peers is None:
                yield b, "", None
                continue
            normal_bar = cfg.peer_fraction * cfg.ttft_enter_seconds
            peers_normal = peers < normal_bar
            enter = ttft >= cfg.ttft_enter_seconds and peers_normal
            stay = ttft >= cfg.ttft_exit_seconds and peers_normal
            severity = Severity.CRITICAL if ttft >= cfg.critical_factor * cfg.ttft_enter_seconds else Severity.WARNING

            def explain() -> tuple[str, list[Evidence]]:
                evidence = [
                    ev("up", 1.0, 1.0, None),
                    ev("ttft_seconds.ewma", ttft, bar(enter, cfg.ttft_enter_seconds, cfg.ttft_exit_seconds), cfg.for_seconds),
                    ev("peers ttft_seconds.ewma (median)", peers, f"< {normal_bar:g}", None),
                ]
                return f"/health answers but TTFT is {ttft:.2f}s while peers serve in {peers:.2f}s", evidence

            yield b, "", self.explained(enter, stay, severity, explain, 0.85)


#: ``requests_finished_total{reason}`` values that are successes, across engines: vLLM/SGLang/
#: trtllm-serve ``finished_reason`` (stop, length, repetition; eos/end_id from other builds) and
#: the ``ok`` the engine collector gives Triton's and TGI's success counters.
SUCCESS_REASONS = frozenset({"stop", "length", "repetition", "eos", "end_id", "ok", "success", "finished"})
#: Reasons that are the client's doing, left out of the ratio entirely (like a client's own
#: quota 429): vLLM/SGLang ``abort`` (the client disconnected), Triton ``canceled``, TGI
#: ``validation`` (the request itself was invalid: a 4xx, the same on any backend).
CLIENT_REASONS = frozenset({"abort", "aborted", "canceled", "cancelled", "validation"})


def finished_reason_class(reason: str) -> str:
    """``ok``, ``client`` or ``error`` for one ``requests_finished_total`` reason.

    Anything not known as a success or a client-side end counts as an error: vLLM
    ``error``, Triton ``backend``/``rejected``/``other``, TGI ``overloaded``/``generation``/
    ``incomplete_generation``, and ``unknown`` (a failure counter without its label).
    """
    if reason in SUCCESS_REASONS:
        return "ok"
    if reason in CLIENT_REASONS:
        return "client"
    return "error"


class ErrorBurst(Rule[ErrorBurstConfig]):
    """(server_5xx + saturated_429) / responses >= ratio_enter over window_seconds (client quota
    429s and other client 4xx excluded).

    Reads ``responses_total{class}`` (the engine collector's reading of the engine's own
    ``http_requests_total{status}``, or gateway feedback); without it, the engine's
    ``requests_finished_total{reason}`` with reasons classified by
    :func:`finished_reason_class` (client-side ends left out of the ratio).
    """

    kind = "error_burst"
    history = reads("b", "responses_total", "requests_finished_total")
    remediation = "Cool the backend down; inspect the engine logs for the failing requests."
    _BAD = frozenset({"server_5xx", "saturated_429"})
    # A tenant's own quota and the engine's other 4xx (bad request, unknown model) are the client's doing.
    _IGNORED = frozenset({"client_ratelimit_429", "client_4xx"})

    def evaluate(self, ctx: Context) -> Iterable[Verdict]:
        cfg = self.config
        for b in ctx.backends:
            signals = ctx.snapshot.backends.get(b, {})
            source, labels = "responses_total", ctx.labelled(signals, "responses_total")
            if labels:
                classes = {k: self._gateway_class(p.get("class", "")) for k, p in labels.items()}
            else:
                source, labels = "requests_finished_total", ctx.labelled(signals, "requests_finished_total")
                classes = {k: finished_reason_class(p.get("reason", "")) for k, p in labels.items()}
            if not labels:
                yield b, "", None
                continue
            total = bad = 0.0
            bad_names: set[str] = set()
            for key, cls in classes.items():
                if cls == "client":
                    continue
                inc = ctx.increase("b", b, f"{source}{{{key}}}", cfg.window_seconds) or 0.0
                total += inc
                if cls == "error":
                    bad += inc
                    if inc > 0:
                        bad_names.add(labels[key].get("class") or labels[key].get("reason") or "?")
            ratio = bad / total if total > 0 else 0.0
            enter = total >= cfg.min_responses and ratio >= cfg.ratio_enter
            stay = total > 0 and ratio >= cfg.ratio_exit
            severity = Severity.CRITICAL if ratio >= cfg.critical_ratio else Severity.WARNING

            def explain() -> tuple[str, list[Evidence]]:
                evidence = [
                    ev(f"{source} error ratio", ratio, bar(enter, cfg.ratio_enter, cfg.ratio_exit), cfg.window_seconds),
                    ev(f"{source} (increase)", total, cfg.min_responses, cfg.window_seconds),
                ]
                what = "/".join(sorted(bad_names)) or ("server_5xx/saturated_429" if source == "responses_total" else "errors")
                return f"{ratio:.1%} of {total:g} responses failed ({what}) in {cfg.window_seconds:g}s", evidence

            yield b, "", self.explained(enter, stay, severity, explain, 0.9 if total >= 5 * cfg.min_responses else 0.7)

    def _gateway_class(self, cls: str) -> str:
        if cls in self._IGNORED:
            return "client"
        return "error" if cls in self._BAD else "ok"

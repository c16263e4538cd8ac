"""The engine metrics collector (SPEC 3.2 "engine", 4 "engine", Appendix A).

Every tick it GETs each backend's ``/metrics`` (``Accept: text/plain;
version=0.0.4``, 1 s deadline, size cap; backends in parallel: those at an
``http://`` IP address from the collecting thread over non-blocking sockets,
:mod:`llmdiag.collectors.http_multi`, the others on a small thread pool), parses it with ``prometheus_client.parser``, maps the
engine's names onto llmdiag's signals (:mod:`llmdiag.collectors.engine_names`)
and turns cumulative values into window values:

* gauges (``requests_waiting``, ``kv_cache_usage``, ...) as read;
* counters (``*_total``) as monotonic totals: the engine's own value until
  it restarts; a counter that went down is a **reset**, counted in
  ``counter_resets_total``, and the total continues from where it was
  (Prometheus ``increase()`` semantics), so a rate computed from two
  snapshots is never negative;
* histograms as a :class:`~llmdiag.model.Distribution` over the window
  between this scrape and the previous one: ``p50``/``p99`` interpolated in
  the *delta* buckets (Prometheus ``histogram_quantile``), ``count`` the
  observations in the window, ``ewma`` an exponentially weighted mean of the
  window means (``alpha`` from ``[engine] ewma_alpha``). A window without
  observations has ``count`` 0, NA quantiles, and keeps the previous EWMA.

**First scrape:** there is no previous scrape, so there is no window: every
distribution is all-NA (``{"p50": null, "p99": null, "ewma": null,
"count": null}``) until the second scrape. Counters and gauges are
available at once.

Each data-parallel engine (vLLM's ``engine`` label) gets its own
``Scope.ENGINE`` samples, and the backend gets an aggregate
(``Scope.BACKEND``): ``max`` for saturation (``kv_cache_usage``), sums for
queue counts and counters, merged window histograms for p50/p99 and the
worst engine's EWMA, so one overloaded engine cannot hide behind a healthy
average (rules in :data:`~llmdiag.collectors.engine_names.AGGREGATION`).

Per backend also: ``up`` (1 when the scrape answered 200 with an engine's
metrics, else 0, with the reason in the collector status),
``scrape_failure{reason}`` while ``up`` is 0 (1 for the one reason of
:data:`SCRAPE_FAILURES` the last scrape failed for; what the ``backend_down``
diagnosis names), ``scrape_age_seconds`` (since the last good scrape; NA
before the first), ``scrape_duration_seconds``. Failures never raise out of
:meth:`EngineCollector.collect`.

A page that answers 200 without any engine's metric names (an HTML page, a
plain web server, another exporter) is *not an engine*: ``up`` 0, reason
``not_an_engine``, unless the backend is configured as ``engine = "openai"``
(an OpenAI-compatible server without a known metrics dialect), which is up
when it answers. A backend with a ``metrics_url`` is scraped there instead of
at ``url`` + ``metrics_path`` (a URL with no path gets ``metrics_path``), so a
``grpc://`` backend with a ``metrics_url`` (Triton: gRPC on 8001, metrics on
8002) is scraped, and its ``up``/``scrape_failure`` read, like any other.
``grpc://`` backends without one have no HTTP ``/metrics`` to scrape: they are
left out (logged once at info, named in the status reason), not counted as
down.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit

from llmdiag.collectors.engine_names import AGGREGATION, Dialect, detect_dialect
from llmdiag.collectors.engine_parse import EngineReading, ExpositionCache, ParsedScrape, parse_exposition, read_engines
from llmdiag.collectors.histogram import CumulativeHistogram, HistogramDelta, counter_delta
from llmdiag.collectors.http_fetch import PROMETHEUS_ACCEPT, SCRAPE_SHARE_OF_TICK, FetchFunction, FetchResult, KeepAlivePool
from llmdiag.collectors.http_multi import MultiFetcher, direct_target
from llmdiag.config.engine import EngineConfig
from llmdiag.model import (
    Backend,
    CollectorState,
    CollectorStatus,
    Distribution,
    Labelled,
    Sample,
    Scope,
    Signals,
)

__all__ = ["SCRAPE_FAILURES", "BackendScrape", "EngineCollector", "scraped_at"]

log = logging.getLogger("llmdiag.collectors.engine")

_NA_DISTRIBUTION = Distribution(None, None, None, None)

#: ``scrape_failure{reason}`` values: why a backend's last scrape failed.
SCRAPE_FAILURES = {
    "connection_refused": "connection refused (nothing listens: the process is gone)",
    "timeout": "scrape timed out (hung or drowning)",
    "name_not_resolved": "host name does not resolve",
    "unreachable": "unreachable (socket error)",
    "not_an_engine": "answers, but not as an engine (no engine metrics, or HTTP 404)",
    "http_error": "HTTP error status",
    "bad_response": "answers, but not HTTP",
    "too_large": "response over the size cap",
    "bad_url": "not an http(s) URL",
    "error": "the scrape failed unexpectedly",
}


def _failure_of(result: FetchResult) -> str:
    """The ``scrape_failure`` reason for a failed fetch."""
    if result.failure == "http_status":
        # No /metrics at that path: a web server, a gateway, anything but an engine.
        return "not_an_engine" if result.status == 404 else "http_error"
    return result.failure if result.failure in SCRAPE_FAILURES else "unreachable"


@dataclass(slots=True)
class BackendScrape:
    """What the last scrape of one backend gave: the normalised signals and how it went."""

    backend: Backend
    up: bool
    engine: str | None = None
    error: str | None = None
    #: One of :data:`SCRAPE_FAILURES` when ``up`` is False.
    failure: str | None = None
    problems: list[str] = field(default_factory=list)
    models: tuple[str, ...] = ()
    signals: Signals = field(default_factory=dict)
    engines: dict[str, Signals] = field(default_factory=dict)

    def copy(self) -> BackendScrape:
        """A copy whose signal maps (and labelled values) can be changed without touching this one."""
        return BackendScrape(
            self.backend, self.up, self.engine, self.error, self.failure, list(self.problems), self.models,
            _copy_signals(self.signals), {label: _copy_signals(signals) for label, signals in self.engines.items()},
        )


def _copy_signals(signals: Signals) -> Signals:
    return {name: Labelled(value) if isinstance(value, dict) else value for name, value in signals.items()}


class _EngineWindow:
    """Previous cumulative values of one DP engine, to compute window values and spot resets."""

    def __init__(self) -> None:
        self.raw: dict[tuple[str, str], float] = {}
        self.totals: dict[tuple[str, str], float] = {}
        self.histograms: dict[str, CumulativeHistogram] = {}
        self.means: dict[str, tuple[float, float]] = {}
        self.ewma: dict[str, float] = {}
        self.resets_total = 0
        #: signal -> (histogram, its empty delta against itself): see advance.
        self.idle: dict[str, tuple[CumulativeHistogram, HistogramDelta]] = {}

    def _total(self, signal: str, label: str, raw: float) -> tuple[float, bool]:
        key = (signal, label)
        previous = self.raw.get(key)
        if previous is None:
            total, reset = raw, False
        else:
            increase, reset = counter_delta(previous, raw)
            total = self.totals[key] + increase
        self.raw[key] = raw
        self.totals[key] = total
        return total, reset

    def _ewma(self, signal: str, mean: float | None, alpha: float) -> float | None:
        if mean is not None and math.isfinite(mean):
            old = self.ewma.get(signal)
            self.ewma[signal] = mean if old is None else alpha * mean + (1 - alpha) * old
        return self.ewma.get(signal)

    def advance(self, reading: EngineReading, alpha: float) -> tuple[Signals, dict[str, HistogramDelta], int]:
        """Signals for this scrape, the window histograms (for the backend merge), and resets seen now."""
        signals: Signals = {}
        resets = 0
        signals.update(reading.gauges)
        for signal, by_reason in reading.labelled_gauges.items():
            signals[signal] = Labelled(by_reason)
        for signal, raw in reading.counters.items():
            signals[signal], reset = self._total(signal, "", raw)
            resets += reset
        for signal, by_reason in reading.labelled_counters.items():
            labelled = Labelled()
            for label, raw in by_reason.items():
                labelled[label], reset = self._total(signal, label, raw)
                resets += reset
            signals[signal] = labelled
        deltas: dict[str, HistogramDelta] = {}
        for signal, hist in reading.histograms.items():
            previous = self.histograms.get(signal)
            self.histograms[signal] = hist
            if previous is None:
                signals[signal] = _NA_DISTRIBUTION
                continue
            if hist is previous:
                # read_engines hands back the very histogram it built last time when the rule's rows
                # did not move: nothing observed since, so the window is the empty delta (the same
                # every time for this histogram, kept) and the EWMA stays where it is.
                idle = self.idle.get(signal)
                if idle is None or idle[0] is not hist:
                    idle = self.idle[signal] = (hist, hist.delta_since(hist)[0])
                delta = deltas[signal] = idle[1]
                if delta.count <= 0:  # always, but for a NaN count (a NaN +Inf bucket, no _count line)
                    signals[signal] = Distribution(None, None, self.ewma.get(signal), 0)
                else:
                    signals[signal] = _distribution(delta, self._ewma(signal, delta.mean(), alpha))
                continue
            delta, reset = hist.delta_since(previous)
            resets += reset
            deltas[signal] = delta
            signals[signal] = _distribution(delta, self._ewma(signal, delta.mean(), alpha))
        for signal, (total, count) in reading.mean_counters.items():
            previous_mean = self.means.get(signal)
            self.means[signal] = (total, count)
            if previous_mean is None:
                signals[signal] = _NA_DISTRIBUTION
                continue
            added, reset_total = counter_delta(previous_mean[0], total)
            finished, reset_count = counter_delta(previous_mean[1], count)
            resets += reset_total or reset_count
            mean = added / finished if finished > 0 else None
            signals[signal] = Distribution(None, None, self._ewma(signal, mean, alpha), _number(finished))
        self.resets_total += resets
        signals["counter_resets_total"] = self.resets_total
        return signals, deltas, resets


def _number(value: float) -> float | int:
    return int(value) if float(value).is_integer() else value


def _distribution(delta: HistogramDelta, ewma: float | None) -> Distribution:
    if delta.count <= 0:
        return Distribution(None, None, ewma, 0)
    return Distribution(*delta.median_and_p99(), ewma, _number(delta.count))


class _BackendTracker:
    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.engines: dict[str, _EngineWindow] = {}
        self.exposition = ExpositionCache()  # the last clean scrape's structure: skip re-parsing labels
        self.last_ok_clock: float | None = None
        self.dialect: Dialect | None = None
        self.resets_logged = 0
        # The last body read and its parse, and the scrape a repeat of it gives (see update_body).
        self.last_body: str | None = None
        self.last_parsed: ParsedScrape | None = None
        self.repeat: BackendScrape | None = None
        self.repeats_total = 0  # scrapes answered from ``repeat`` (the unit tests and the benchmark read it)
        self.last_was_repeat = False  # the last update_body answered from ``repeat``
        # ``repeat``'s samples (backend scope, engine scope), built once: see EngineCollector._samples.
        self.repeat_samples: tuple[list[Sample], list[Sample]] | None = None
        # The last sample of each (engine or None for the backend, signal): see EngineCollector._reused_samples.
        self.sample_cache: dict[tuple[str | None, str], Sample] = {}

    def update_body(self, body: str, fetched_at: float, alpha: float) -> BackendScrape:
        """The scrape of one ``/metrics`` body: parsed, mapped and stepped, unless it repeats the last one.

        An idle engine's counters do not move, so at light traffic many scrapes are the previous
        body byte for byte (~40 % with 16 fake engines at 4 requests/s). Such a body is not parsed
        again: it steps the windows with the last parse. After that one step the windows are at a
        fixed point for this body (no counter increase, no new histogram observation, so no EWMA
        change and no reset), so every further repeat gives the same signals, and the scrape is
        reused whole (a copy: the collector adds the per-scrape ``up``, ``scrape_*`` signals).
        Any other body, even one value changed, goes the full way."""
        self.last_was_repeat = False
        if body == self.last_body and self.last_parsed is not None:
            if self.repeat is not None:
                self.last_ok_clock = fetched_at
                self.repeats_total += 1
                self.last_was_repeat = True
                return self.repeat.copy()
            scrape = self.update(self.last_parsed, fetched_at, alpha)
            if scrape.up:
                self.repeat, self.repeat_samples = scrape.copy(), None
            return scrape
        self.last_body = self.last_parsed = self.repeat = self.repeat_samples = None  # set again once this body is read
        parsed = parse_exposition(body, self.exposition)
        scrape = self.update(parsed, fetched_at, alpha)
        self.last_body, self.last_parsed = body, parsed
        return scrape

    def update(self, parsed: ParsedScrape, fetched_at: float, alpha: float) -> BackendScrape:
        memo = parsed.memo
        if memo is not None and "dialect" in memo:
            dialect = memo["dialect"]  # the same names as when it was detected
        else:
            dialect = detect_dialect(parsed.names(), self.backend.engine)
            if memo is not None:
                memo["dialect"] = dialect
        scrape = BackendScrape(self.backend, up=True, problems=list(parsed.problems))
        if dialect is None:
            scrape.error = "no known engine metrics (vllm:, sglang:, trtllm_, nv_trt_llm_, nv_inference_, tgi_)"
            if self.backend.engine != "openai":
                # An HTML page or another exporter answering on the port: not an engine, so not up.
                scrape.up, scrape.failure = False, "not_an_engine"
                return scrape
            self.last_ok_clock = fetched_at
            return scrape
        self.last_ok_clock = fetched_at
        if self.dialect is not None and dialect is not self.dialect:
            self.engines.clear()  # another engine now answers on this port: old windows mean nothing
        self.dialect = dialect
        reading = read_engines(parsed, dialect)
        scrape.engine, scrape.models = dialect.engine, reading.models
        scrape.problems.extend(reading.problems)
        deltas_by_engine: dict[str, dict[str, HistogramDelta]] = {}
        resets_now = 0
        for label in sorted(reading.engines, key=_engine_order):
            window = self.engines.setdefault(label, _EngineWindow())
            signals, deltas, resets = window.advance(reading.engines[label], alpha)
            scrape.engines[label] = signals
            deltas_by_engine[label] = deltas
            resets_now += resets
        if resets_now:
            scrape.problems.append(f"{resets_now} counter reset(s): engine restarted?")
            log.warning("backend %s: %d counter reset(s) (engine restart?)", self.backend.name, resets_now)
        scrape.signals = _aggregate(scrape.engines, deltas_by_engine)
        return scrape


def _engine_order(label: str) -> tuple[int, str]:
    return (int(label), label) if label.isdigit() else (1 << 30, label)


def _aggregate(engines: dict[str, Signals], deltas: dict[str, dict[str, HistogramDelta]]) -> Signals:
    """The backend's signals from its engines' (see AGGREGATION in engine_names)."""
    if len(engines) == 1:
        return _single(next(iter(engines.values())))
    out: Signals = {}
    names = {name for signals in engines.values() for name in signals}
    for name in sorted(names):
        values = [signals[name] for signals in engines.values() if name in signals]
        first = values[0]
        if isinstance(first, Distribution):
            out[name] = _merge_distributions(name, values, [d[name] for d in deltas.values() if name in d])
        elif isinstance(first, dict):
            merged = Labelled()
            for value in values:
                for key, number in value.items():  # type: ignore[union-attr]
                    merged[key] = merged.get(key, 0) + number
            out[name] = merged
        else:
            numbers = [float(v) for v in values if isinstance(v, (int, float))]
            if numbers:
                total = max(numbers) if AGGREGATION.get(name) == "max" else math.fsum(numbers)
                out[name] = _number(total) if name.endswith("_total") else total
    return out


def _single(signals: Signals) -> Signals:
    """:func:`_aggregate` of one engine, without the merging: the same values (numbers as floats,
    ``*_total`` ones integral where they are whole, labelled values copied), in the same order."""
    out: Signals = {}
    for name in sorted(signals):
        value = signals[name]
        kind = type(value)
        if kind is Distribution:
            out[name] = value
        elif kind is float or kind is int:
            # fsum([x]) is x, except that it turns -0.0 into 0.0: so does adding 0.0
            is_max, is_total = _NAME_RULES.get(name) or _name_rules(name)
            total = float(value) if is_max else float(value) + 0.0
            out[name] = _number(total) if is_total else total
        elif isinstance(value, Distribution):
            out[name] = value
        elif isinstance(value, dict):
            out[name] = Labelled({key: 0 + number for key, number in value.items()})
        elif isinstance(value, (int, float)):
            total = float(value) if AGGREGATION.get(name) == "max" else float(value) + 0.0
            out[name] = _number(total) if name.endswith("_total") else total
    return out


#: signal -> (aggregated by max, a *_total name): what _single asks of every number, worked out once.
_NAME_RULES: dict[str, tuple[bool, bool]] = {}


def _name_rules(name: str) -> tuple[bool, bool]:
    rules = (AGGREGATION.get(name) == "max", name.endswith("_total"))
    if len(_NAME_RULES) < 4096:  # signal names are a fixed set; stay bounded all the same
        _NAME_RULES[name] = rules
    return rules


def _merge_distributions(name: str, values: list, deltas: list[HistogramDelta]) -> Distribution:
    if len(values) == 1 and len(deltas) <= 1:
        # One engine (no data parallelism): merging its one window histogram gives back its own
        # quantiles, EWMA and count, so its distribution is the backend's as it is.
        return values[0]
    ewmas = [v.ewma for v in values if v.ewma is not None]
    counts = [v.count for v in values if v.count is not None]
    ewma = max(ewmas) if ewmas else None  # the worst engine's: saturation must not average away
    count = _number(math.fsum(counts)) if counts else None
    if not deltas:
        return Distribution(None, None, ewma, count)
    layouts = {tuple(le for le, _ in d.buckets) for d in deltas}
    if len(layouts) == 1:
        merged = CumulativeHistogram.build(
            (pair for d in deltas for pair in d.buckets), sum(d.count for d in deltas), 0.0
        )
        delta = HistogramDelta(merged.buckets, merged.count, 0.0)
        if delta.count > 0:
            return Distribution(*delta.median_and_p99(), ewma, count)
        return Distribution(None, None, ewma, count)
    # Engines with different bucket layouts cannot be merged: report the worst engine's quantiles.
    p50s = [v.p50 for v in values if v.p50 is not None]
    p99s = [v.p99 for v in values if v.p99 is not None]
    return Distribution(max(p50s) if p50s else None, max(p99s) if p99s else None, ewma, count)


def scraped_at(backend: Backend, metrics_path: str = "/metrics") -> str | None:
    """The URL the engine collector scrapes for ``backend``: its ``metrics_url`` when set
    (``metrics_path`` appended when that URL has no path), else ``url`` + ``metrics_path``
    for HTTP backends; ``None`` for a ``grpc://`` backend without a ``metrics_url``."""
    if backend.metrics_url:
        if urlsplit(backend.metrics_url).path in ("", "/"):
            return backend.metrics_url.rstrip("/") + metrics_path
        return backend.metrics_url
    if backend.scheme == "grpc":
        return None
    return backend.url.rstrip("/") + metrics_path


class EngineCollector:
    """Scrapes every backend's engine metrics once per :meth:`collect`.

    ``fetch(url, timeout, max_bytes, accept) -> FetchResult`` and ``clock``
    (monotonic seconds) are injectable; the defaults are a
    :class:`~llmdiag.collectors.http_multi.MultiFetcher` for ``http://`` backends
    at an IP address and a :class:`~llmdiag.collectors.http_fetch.KeepAlivePool`
    in threads for the others (one kept-alive connection per backend either way,
    closed with the collector) and ``time.monotonic``. An injected ``fetch`` serves
    every backend, on the thread pool.
    """

    name = "engine"

    def __init__(
        self,
        backends: Iterable[Backend],
        config: EngineConfig | None = None,
        fetch: FetchFunction | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config or EngineConfig()
        backends = list(backends)
        # gRPC ports serve no HTTP /metrics: scraping them would only ever say "down". One that
        # names where its engine's metrics live (metrics_url) is scraped there.
        urls = {b.name: scraped_at(b, self.config.metrics_path) for b in backends}
        self.backends = [b for b in backends if urls[b.name] is not None]
        self.skipped = [b for b in backends if urls[b.name] is None]
        self._urls: dict[str, str] = {name: url for name, url in urls.items() if url is not None}
        if self.skipped:
            log.info(
                "engine metrics: not scraping gRPC backend(s) %s (no HTTP /metrics and no metrics_url; "
                "the http2 collector watches them)",
                ", ".join(b.name for b in self.skipped),
            )
        self._connections = KeepAlivePool() if fetch is None else None
        self._multi = MultiFetcher() if fetch is None else None
        # http:// backends at an IP address: all from the collecting thread, each answer read as it
        # arrives (MultiFetcher); the others (https, host names, an injected fetch) on the thread pool.
        # The backends are fixed for the collector's life, so the split is made once.
        self._direct = [b for b in self.backends if self._multi is not None and direct_target(self._urls[b.name])]
        direct_names = {b.name for b in self._direct}
        self._threaded = [b for b in self.backends if b.name not in direct_names]
        self._fetch_url: FetchFunction = fetch or self._connections  # type: ignore[assignment]
        self._clock = clock
        self._trackers = {b.name: _BackendTracker(b) for b in self.backends}
        self._pool: ThreadPoolExecutor | None = None
        self.results: dict[str, BackendScrape] = {}
        self._last_ok_ts: float | None = None
        self._errors_total = 0

    # -- the contract ----------------------------------------------------
    def collect(self, now: float) -> list[Sample]:
        """Scrape all backends (in parallel) and return engine and backend samples. Never raises."""
        samples: list[Sample] = []
        for backend, scrape in zip(self.backends, self._scrape_all(), strict=True):
            self.results[backend.name] = scrape
            tracker = self._trackers[backend.name]
            if scrape.up and tracker.last_was_repeat and tracker.repeat is not None:
                samples.extend(self._repeat_samples(tracker, scrape))
            elif scrape.up:
                samples.extend(self._reused_samples(tracker, scrape))
            else:
                samples.extend(self._samples(scrape))
        if self.results and any(r.up for r in self.results.values()):
            self._last_ok_ts = now
        return samples

    def status(self) -> CollectorStatus:
        skipped = f"gRPC backend(s) not scraped (no HTTP /metrics, no metrics_url): {', '.join(b.name for b in self.skipped)}" if self.skipped else None
        if not self.backends:
            return CollectorStatus(CollectorState.UNAVAILABLE, skipped or "no backends configured or discovered", None, 0)
        troubles = []
        for name, scrape in self.results.items():
            if not scrape.up:
                troubles.append(f"{name}: down ({scrape.error})")
            elif scrape.error:
                troubles.append(f"{name}: {scrape.error}")
            elif scrape.problems:
                troubles.append(f"{name}: {scrape.problems[0]}")
        if troubles:
            if skipped:
                troubles.append(skipped)
            return CollectorStatus(CollectorState.DEGRADED, "; ".join(troubles), self._last_ok_ts, self._errors_total)
        return CollectorStatus(CollectorState.OK, skipped, self._last_ok_ts, self._errors_total)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        if self._connections is not None:
            self._connections.close()
        if self._multi is not None:
            self._multi.close()

    # -- work ------------------------------------------------------------
    def _scrape_all(self) -> list[BackendScrape]:
        if not self.backends:
            return []
        direct, threaded = self._direct, self._threaded
        futures = []
        if threaded:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=min(self.config.max_workers, len(self.backends)), thread_name_prefix="llmdiag-engine"
                )
            futures = [self._pool.submit(self._fetch, b) for b in threaded]
        done: dict[str, BackendScrape] = {}
        if direct:
            assert self._multi is not None
            answers = self._multi.fetch_all([self._urls[b.name] for b in direct], self.config.timeout_seconds,
                                            self.config.max_response_bytes, PROMETHEUS_ACCEPT)
            for index, result in answers:
                backend = direct[index]
                done[backend.name] = self._read(self._trackers[backend.name], result, self._clock())
        # The fetch has its own deadline; the extra second only bounds an injected fetch that ignores it.
        budget = self.config.timeout_seconds + 1.0
        for backend, future in zip(threaded, futures, strict=True):
            tracker = self._trackers[backend.name]
            try:
                result, fetched_at = future.result(timeout=budget)
            except FutureTimeout:
                done[backend.name] = self._down(tracker, f"timed out after {self.config.timeout_seconds:g} s", "timeout")
                continue
            except Exception as exc:  # noqa: BLE001 - an injected fetch may raise anything
                self._errors_total += 1
                done[backend.name] = self._down(tracker, f"{type(exc).__name__}: {exc}", "error")
                continue
            done[backend.name] = self._read(tracker, result, fetched_at)
        return [done[b.name] for b in self.backends]

    def _read(self, tracker: _BackendTracker, result: FetchResult, fetched_at: float) -> BackendScrape:
        """The scrape one fetch gave (parsed here, in the collecting thread: a backend's windows are
        only ever touched here)."""
        if not result.ok:
            return self._down(tracker, result.error or "no answer", _failure_of(result))
        try:
            scrape = tracker.update_body(result.body, fetched_at, self.config.ewma_alpha)
        except Exception as exc:  # noqa: BLE001 - a bug or a scrape we did not foresee: degrade, do not stop
            self._errors_total += 1
            log.warning("backend %s: could not read the scrape: %s", tracker.backend.name, exc, exc_info=True)
            scrape = BackendScrape(tracker.backend, up=True, error=f"could not read the scrape: {type(exc).__name__}: {exc}")
        if not scrape.up:
            return self._down(tracker, scrape.error or "not an engine", scrape.failure or "not_an_engine")
        scrape.signals["up"] = 1
        scrape.signals["scrape_duration_seconds"] = result.elapsed_seconds
        scrape.signals["scrape_age_seconds"] = max(0.0, self._clock() - fetched_at)
        return scrape

    def _fetch(self, backend: Backend) -> tuple[FetchResult, float]:
        result = self._fetch_url(self._urls[backend.name], self.config.timeout_seconds, self.config.max_response_bytes, PROMETHEUS_ACCEPT)
        return result, self._clock()

    def _down(self, tracker: _BackendTracker, reason: str, failure: str) -> BackendScrape:
        engine = tracker.dialect.engine if tracker.dialect else None
        scrape = BackendScrape(tracker.backend, up=False, error=reason, engine=engine, failure=failure)
        age = None if tracker.last_ok_clock is None else max(0.0, self._clock() - tracker.last_ok_clock)
        scrape.signals = {"up": 0, "scrape_age_seconds": age, "scrape_failure": Labelled({f"reason={failure}": 1})}
        return scrape

    @staticmethod
    def _repeat_samples(tracker: _BackendTracker, scrape: BackendScrape) -> list[Sample]:
        """:meth:`_samples` of a scrape answered from ``tracker.repeat``: the same samples in the same
        order, those of the repeat built once (samples are frozen; a labelled value is copied each
        time, as the scrape's own copy is) and only the per-scrape ``up``/``scrape_*`` ones new."""
        assert tracker.repeat is not None
        name = scrape.backend.name
        if tracker.repeat_samples is None:
            repeat = tracker.repeat
            tracker.repeat_samples = (
                [Sample(Scope.BACKEND, name, signal, value) for signal, value in repeat.signals.items()],
                [Sample(Scope.ENGINE, name, signal, value, engine=engine)
                 for engine, signals in repeat.engines.items() for signal, value in signals.items()],
            )
        backend_part, engine_part = tracker.repeat_samples
        fixed = len(backend_part)
        out = [_fresh(s) for s in backend_part]
        out += [Sample(Scope.BACKEND, name, signal, value) for signal, value in list(scrape.signals.items())[fixed:]]
        out += [_fresh(s) for s in engine_part]
        return out

    @staticmethod
    def _reused_samples(tracker: _BackendTracker, scrape: BackendScrape) -> list[Sample]:
        """:meth:`_samples` of a scrape, reusing the sample of each signal whose value is the very
        same (type and float bits) as in the backend's last scrape: at light traffic most gauges,
        counters and idle distributions did not move, and a sample is frozen, so handing out the
        last one is handing out an equal one. Labelled values are always new (consumers own theirs)."""
        name = scrape.backend.name
        cache = tracker.sample_cache
        if len(cache) > 4096:  # engines or signals churning: do not grow without bound
            cache.clear()
        out: list[Sample] = []
        append = out.append
        for engine, signals in ((None, scrape.signals), *scrape.engines.items()):
            scope = Scope.BACKEND if engine is None else Scope.ENGINE
            for signal, value in signals.items():
                key = (engine, signal)
                old = cache.get(key)
                if old is not None and _same(old.value, value):
                    append(old)
                    continue
                sample = Sample(scope, name, signal, value, engine=engine)
                if not isinstance(value, dict):
                    cache[key] = sample
                append(sample)
        return out

    @staticmethod
    def _samples(scrape: BackendScrape) -> list[Sample]:
        name = scrape.backend.name
        samples = [Sample(Scope.BACKEND, name, signal, value) for signal, value in scrape.signals.items()]
        for engine, signals in scrape.engines.items():
            samples.extend(Sample(Scope.ENGINE, name, signal, value, engine=engine) for signal, value in signals.items())
        return samples


def _same(old: object, new: object) -> bool:
    """Whether a sample holding ``old`` is exactly one holding ``new``: same type, same value, and
    the same sign of zero (0.0 == -0.0 and 1 == 1.0, but they print differently). Labelled values
    are never the same (each sample owns a copy); NaN is not itself (built anew, as before)."""
    if old is new and not isinstance(new, dict):
        return True
    kind = type(new)
    if type(old) is not kind:
        return False
    if kind is float:
        return old == new and (new != 0.0 or math.copysign(1.0, old) == math.copysign(1.0, new))  # type: ignore[arg-type]
    if kind is int:
        return old == new
    if kind is Distribution:
        return (_same(old.p50, new.p50) and _same(old.p99, new.p99) and _same(old.ewma, new.ewma)  # type: ignore[attr-defined]
                and _same(old.count, new.count))  # type: ignore[attr-defined]
    return False


def _fresh(sample: Sample) -> Sample:
    """``sample`` itself, or a copy holding a copy of its labelled value (consumers own theirs)."""
    if isinstance(sample.value, dict):
        return Sample(sample.scope, sample.subject, sample.name, Labelled(sample.value), sample.engine)
    return sample



def build_engine_collector(config, backends: list[Backend]) -> EngineCollector:
    """``COLLECTOR_FACTORIES["engine"]``: the collector for the configured (or discovered) backends.

    The scrape deadline is ``[engine] timeout_seconds`` but never more than 0.8 of
    ``[agent] interval_seconds``: a tick waits for its slowest scrape, so with the defaults (1 s
    and 1 s) one hung engine made every tick last over a second, and the agent missed every other
    tick for as long as the engine hung (its other backends seen every 2 s, the missed-ticks alert
    firing for an engine's fault). Capped, the hung engine is still reported (``timeout``) each
    tick and the others keep their cadence.
    """
    engine = config.engine
    cap = SCRAPE_SHARE_OF_TICK * config.agent.interval_seconds
    if engine.timeout_seconds > cap:
        log.debug("engine scrape deadline %.3g s (0.8 of the %g s tick) instead of %g s",
                  cap, config.agent.interval_seconds, engine.timeout_seconds)
        engine = replace(engine, timeout_seconds=cap)
    return EngineCollector(backends, engine)

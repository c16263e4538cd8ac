"""Parse one engine scrape and read its raw engine values (no time window yet).

:func:`parse_exposition` runs ``prometheus_client.parser`` over the lines
that can matter (those some rule reads: ``python_gc_*``, ``process_*``
and ``http_*`` series other than ``http_requests_total`` are dropped
first, which halves the parse time of a real vLLM scrape). A malformed line does not lose the
scrape: the bad lines are found one by one, reported with their line number,
and the rest is parsed.

Between two scrapes of one engine only the numbers change: the series, their
labels and their order stay. Given an :class:`ExpositionCache` (one per
backend), a scrape whose kept lines are the last clean scrape's lines with
only the values changed reuses that parse's names and labels and converts
the values alone (no label parsing, ~10x cheaper); any other difference (a
new series, a timestamp, a comment, a value the parser would refuse) goes
through the full parser again, so the result is the same either way. Such a
scrape also carries the structure's :attr:`ParsedScrape.memo`, where
:func:`read_engines` (and the collector) keep what depends on names and labels
alone: which rows each rule reads for which engine, the model names, the
dialect. They are worked out once per structure, not once per scrape.

:func:`read_engines` applies a :class:`~llmdiag.collectors.engine_names.Dialect`
and returns one :class:`EngineReading` per data-parallel engine: gauges,
cumulative counters and cumulative histograms, still as the engine counts
them. Turning those into window signals is the collector's job.
"""

from __future__ import annotations

import math
from collections import defaultdict
from itertools import compress, count
from operator import ne
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from llmdiag.collectors.engine_names import (
    AGGREGATION,
    DIALECTS,
    UNCOUNTED_HANDLERS,
    Dialect,
    Kind,
    Rule,
    canonical_name,
    response_class,
)
from llmdiag.collectors.histogram import CumulativeHistogram
from llmdiag.model import label_key

__all__ = ["EngineReading", "ExpositionCache", "ParsedScrape", "parse_exposition", "read_engines"]

#: Engine label value for engines that expose no data-parallel label.
DEFAULT_ENGINE = "0"

_MAX_PROBLEMS = 20
_SUFFIXES = ("", "_bucket", "_count", "_sum")


def _wanted_names() -> frozenset[str]:
    """Canonical names of every series some rule reads (histogram parts included)."""
    names = set()
    for dialect in DIALECTS:
        for rule in dialect.rules:
            # A histogram whose own name ends in _total (vllm:iteration_tokens_total) keeps it in
            # its parts' names: _total_count, not _count.
            for base in (rule.canonical, rule.canonical_other, rule.metric.replace(":", "_")):
                if base:
                    names.update(base + suffix for suffix in _SUFFIXES)
    return frozenset(names)


#: Only these series are handed to the parser: a real vLLM scrape is half
#: python_gc_*/process_*/http_* and unused histograms, and parsing is the cost.
WANTED = _wanted_names()

Labels = dict[str, str]
Series = list[tuple[Labels, float]]


@dataclass(slots=True)
class ParsedScrape:
    """Samples of one scrape by canonical name, and what was wrong with it."""

    series: dict[str, Series] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    lines: int = 0
    #: Shared by every scrape of one structure (same series, labels and order; see the module
    #: docstring), None after a full parse. Its rows' label dicts are shared too: read-only.
    memo: dict | None = field(default=None, compare=False, repr=False)

    def names(self) -> frozenset[str]:
        return frozenset(self.series)


def _keep(line: str) -> bool:
    if line.startswith("#"):
        # Keep "# TYPE name kind" of wanted families (it groups histogram samples); drop HELP and comments.
        if not line.startswith("# TYPE "):
            return False
        name = line[7:].split(" ", 1)[0]
    else:
        name = line.split("{", 1)[0].split(" ", 1)[0]
    return canonical_name(name) in WANTED


class ExpositionCache:
    """The structure of one engine's last clean scrape, one per backend: every line without its
    value, the kept comment lines whole, and the line, canonical name and labels of each kept
    sample line, in order."""

    __slots__ = ("last", "state")

    def __init__(self) -> None:
        # (heads of every line, (line index, canonical name, labels) per kept sample line, the
        # structure's memo, (line index, line) per kept comment line), swapped as one tuple: a
        # late scrape of the same backend in another thread reads either the old or the new one.
        self.state: tuple[list[str], tuple[tuple[int, str, Labels], ...], dict, tuple[tuple[int, str], ...]] | None = None
        # (the state it was read with, lines, value per slot, series) of the last scrape read from
        # ``state``: what the next one is compared with (see _fast_values).
        self.last: tuple | None = None


def _heads(lines: list[str]) -> list[str]:
    """Each line up to its last space (a sample line without its value); a line without a space whole."""
    return [line.rpartition(" ")[0] or line for line in lines]


def _shape(line: str) -> tuple[str, str | None]:
    """``(the line without its value, the value)``; comments (and lines we do not split) whole, value None."""
    if line.startswith("#") or not line:
        return line, None
    brace = line.find("{")
    end = line.rfind("}") + 1 if brace >= 0 else line.find(" ")
    if end <= 0:
        return line, None
    rest = line[end:].split()
    if len(rest) != 1:  # a timestamp, or nothing: the full parser decides
        return line, None
    return line[:end], rest[0]


def _fast_values(lines: list[str], cache: ExpositionCache) -> tuple[dict[str, Series], dict] | None:
    """The series of ``lines`` from the cached structure and its memo, or None unless only values changed.

    Every line's head (the line up to its last space) must be the cached one: same lines, same
    names and labels, in the same order, so the same lines are kept (whether a line is kept
    depends on its name alone). Kept comment lines (``# TYPE``) must be the same whole. Each kept
    sample's value must be a number the exposition parser would take too.

    After one such scrape, the next is compared with it line by line (a C-level pass): only the
    lines that differ are checked against the structure and have their value read, and the rows
    of every series none of whose lines changed are the last scrape's own (so read_engines sees
    them unmoved at once). Lines equal to the last scrape's passed these checks then."""
    state = cache.state
    if state is None:
        return None
    heads = state[0]
    if len(lines) != len(heads):
        return None
    last = cache.last
    if last is not None and last[0] is state:
        found = _changed_values(lines, state, last)
    else:
        found = _all_values(lines, state)
    if found is None:
        return None
    numbers, series = found
    cache.last = (state, lines, numbers, series)
    return dict(series), state[2]


def _all_values(lines: list[str], state: tuple) -> tuple[list[float], dict[str, Series]] | None:
    heads, slots, _, comments = state
    if _heads(lines) != heads:
        return None
    for index, line in comments:
        if lines[index] != line:
            return None
    values = [lines[index].rpartition(" ")[2] for index, _, _ in slots]
    if "_" in " ".join(values):  # float() takes "1_000"; the exposition parser does not
        return None
    try:
        numbers = list(map(float, values))
    except ValueError:
        return None
    series: dict[str, Series] = defaultdict(list)
    for (_, name, labels), number in zip(slots, numbers, strict=True):
        series[name].append((labels, number))  # the cached dict: nothing downstream writes to labels
    return numbers, dict(series)


def _slot_index(state: tuple) -> tuple[dict[int, int], dict[str, list[int]], frozenset[int]]:
    """For a structure: the slot of each kept sample line, the slots of each series, the kept
    comment lines (kept in the structure's memo: worked out once)."""
    memo = state[2]
    index = memo.get("slot index")
    if index is None:
        slot_at: dict[int, int] = {}
        rows_of: dict[str, list[int]] = {}
        for k, (line, name, _) in enumerate(state[1]):
            slot_at[line] = k
            rows_of.setdefault(name, []).append(k)
        index = memo["slot index"] = (slot_at, rows_of, frozenset(i for i, _ in state[3]))
    return index


def _changed_values(lines: list[str], state: tuple, last: tuple) -> tuple[list[float], dict[str, Series]] | None:
    """:func:`_all_values` of ``lines`` given the last scrape of the same structure (see _fast_values)."""
    heads, slots = state[0], state[1]
    _, last_lines, numbers, series = last
    changed = list(compress(count(), map(ne, lines, last_lines)))
    if not changed:
        return numbers, series
    slot_at, rows_of, comment_lines = _slot_index(state)
    moved: list[tuple[int, str]] = []
    for i in changed:
        line = lines[i]
        head, _, value = line.rpartition(" ")
        if (head or line) != heads[i] or i in comment_lines:
            return None  # another line, or a kept comment line that is not the structure's own
        k = slot_at.get(i)
        if k is not None:
            moved.append((k, value))
    if not moved:
        return numbers, series
    if "_" in " ".join(value for _, value in moved):  # as in _all_values
        return None
    numbers = list(numbers)
    names = set()
    try:
        for k, value in moved:
            numbers[k] = float(value)
            names.add(slots[k][1])
    except ValueError:
        return None
    series = dict(series)
    for name in names:
        series[name] = [(slots[k][2], numbers[k]) for k in rows_of[name]]
    return numbers, series


def _remember(lines: list[str], kept: list[tuple[int, str]], samples: list[tuple[str, Labels]], cache: ExpositionCache) -> None:
    """Keep the structure of a clean full parse when its samples map one to one, in order, on its
    kept lines, and each of those lines is ``name{labels} value`` with one space before the value."""
    comments: list[tuple[int, str]] = []
    sample_lines: list[tuple[int, str]] = []
    for lineno, line in kept:
        if line.startswith("#") or not line:
            comments.append((lineno - 1, line))
            continue
        shape, value = _shape(line)
        if value is None or line.rpartition(" ")[0] != shape:
            cache.state = None  # a sample line we cannot split (timestamp, odd spacing...): no fast path
            return
        sample_lines.append((lineno - 1, shape.split("{", 1)[0].strip()))
    # The parser names an untyped-suffix counter sample ``x`` as ``x_total``: still the same line.
    if len(sample_lines) != len(samples) or any(
        s not in (n, n + "_total") for (_, n), (s, _) in zip(sample_lines, samples, strict=True)
    ):
        cache.state = None
        return
    slots = tuple((index, canonical_name(s), dict(labels)) for (index, _), (s, labels) in zip(sample_lines, samples, strict=True))
    cache.state = (_heads(lines), slots, {}, tuple(comments))


def parse_exposition(text: str, cache: ExpositionCache | None = None) -> ParsedScrape:
    """Parse Prometheus text exposition (0.0.4, or OpenMetrics read as text).

    Never raises: unparsable lines become ``problems`` entries such as
    ``"line 17: ..."`` and are left out. ``cache`` (one per engine) lets a scrape
    that differs from the last clean one only in its values skip the label parsing.
    """
    all_lines = text.split("\n")
    parsed = ParsedScrape(lines=len(all_lines))
    if cache is not None:
        fast = _fast_values(all_lines, cache)
        if fast is not None:
            parsed.series, parsed.memo = fast
            return parsed
    kept = [(i, line) for i, line in enumerate(all_lines, 1) if _keep(line)]
    kept_lines = [line for _, line in kept]
    try:
        samples = _collect(parsed, "\n".join(kept_lines) + "\n")
        if cache is not None:
            _remember(all_lines, kept, samples, cache)
        return parsed
    except Exception:  # noqa: BLE001 - any parser failure: find the bad lines instead
        parsed.series.clear()
        if cache is not None:
            cache.state = None
    good: list[str] = []
    for lineno, line in kept:
        try:
            list(text_string_to_metric_families(line + "\n"))
        except Exception as exc:  # noqa: BLE001
            if len(parsed.problems) < _MAX_PROBLEMS:
                parsed.problems.append(f"line {lineno}: {type(exc).__name__}: {exc} in {line[:80]!r}")
            continue
        good.append(line)
    try:
        _collect(parsed, "\n".join(good) + "\n")
    except Exception as exc:  # noqa: BLE001 - lines fine alone but not together (e.g. a TYPE clash)
        parsed.series.clear()
        parsed.problems.append(f"exposition unparsable as a whole: {type(exc).__name__}: {exc}")
    return parsed


def _collect(parsed: ParsedScrape, text: str) -> list[tuple[str, Labels]]:
    """Fill ``parsed.series``; returns ``(sample name, labels)`` in the parser's order."""
    series: dict[str, Series] = defaultdict(list)
    order: list[tuple[str, Labels]] = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series[canonical_name(sample.name)].append((sample.labels, float(sample.value)))
            order.append((sample.name, sample.labels))
    parsed.series = dict(series)
    return order


@dataclass(slots=True)
class EngineReading:
    """Raw values of one data-parallel engine from one scrape."""

    gauges: dict[str, float] = field(default_factory=dict)
    labelled_gauges: dict[str, dict[str, float]] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    labelled_counters: dict[str, dict[str, float]] = field(default_factory=dict)
    histograms: dict[str, CumulativeHistogram] = field(default_factory=dict)
    #: signal -> (cumulative total in base units, cumulative count)
    mean_counters: dict[str, tuple[float, float]] = field(default_factory=dict)


@dataclass(slots=True)
class Reading:
    engines: dict[str, EngineReading]
    models: tuple[str, ...]
    problems: list[str]


def _matches(labels: Labels, match: tuple[tuple[str, str], ...]) -> bool:
    return all(labels.get(k) == v for k, v in match)


def _engine_of(labels: Labels, dialect: Dialect) -> str:
    if dialect.engine_label is None:
        return DEFAULT_ENGINE
    return labels.get(dialect.engine_label) or DEFAULT_ENGINE


def _clean_label(value: str) -> str:
    # label_key() refuses ',' (the pair separator) and values come from the wire.
    return value.replace(",", "_").replace("=", "_") or "unknown"


def _combine(signal: str, values: list[float]) -> float:
    return max(values) if AGGREGATION.get(signal) == "max" else math.fsum(values)


def _finite(values: list[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


def read_engines(parsed: ParsedScrape, dialect: Dialect) -> Reading:
    """Apply ``dialect`` to a parsed scrape: one :class:`EngineReading` per engine label."""
    problems: list[str] = []
    # With a structure memo, a rule whose input rows are the ones it read in the last scrape of
    # this structure (an idle histogram, an unchanged gauge) gives what it gave then: its result
    # is kept per rule, and only the rules whose rows moved run again.
    memo = parsed.memo
    series = parsed.series
    last = memo.get(("rules", dialect.engine)) if memo is not None else None
    moved: set[str] = set()
    inputs: list[frozenset[str]] = []
    if last is not None:
        # One comparison per series (the label dicts are the structure's own, so mostly identity).
        moved = {name for name, rows in series.items() if rows != last[0].get(name)}
        inputs = last[2]
    elif memo is not None:
        inputs = [frozenset(_rule_inputs(rule)) for rule in dialect.rules]
    outputs: list[tuple[dict | None, list[str]]] = []
    rerun: list[int] = []
    for i, rule in enumerate(dialect.rules):
        if last is not None and moved.isdisjoint(inputs[i]):
            per_engine, added = last[1][i]
            problems.extend(added)
        else:
            rerun.append(i)
            before = len(problems)
            try:
                per_engine = _apply(rule, parsed, dialect, problems)
            except (ValueError, ArithmeticError) as exc:
                problems.append(f"{rule.metric}: {exc}")
                per_engine = None
            added = problems[before:]
        outputs.append((per_engine, added))
    built = _patched(dialect, outputs, rerun, last) if last is not None else None
    if built is None:
        built = _build(dialect, outputs)
    engines, won = built
    if memo is not None:
        # The readings are kept (read-only) for the next scrape of this structure to patch.
        memo[("rules", dialect.engine)] = (series, outputs, inputs, engines, won)
    models = parsed.memo.get("models") if parsed.memo is not None else None
    if models is None:
        models = tuple(sorted({
            labels[name]
            for rows in parsed.series.values()
            for labels, _ in rows[:64]
            for name in ("model_name", "model")
            if labels.get(name)
        }))
        if parsed.memo is not None:
            parsed.memo["models"] = models
    return Reading(dict(engines), models, problems)


#: Rule kinds whose store sets one value (``reading.<part>[signal] = value``), never merges into one.
_PLAIN_KINDS = frozenset({Kind.GAUGE, Kind.COUNTER, Kind.HISTOGRAM, Kind.HISTOGRAM_SUM_COUNTER,
                          Kind.HISTOGRAM_COUNT_COUNTER, Kind.MEAN_COUNTERS, Kind.RATIO, Kind.PRODUCT,
                          Kind.INFO_PRODUCT})


def _build(dialect: Dialect, outputs: list[tuple[dict | None, list[str]]]) -> tuple[dict[str, EngineReading], list[list[str]]]:
    """The engines' readings from every rule's output, in rule order, and per rule the engines its
    store was applied to (where it won)."""
    engines: dict[str, EngineReading] = defaultdict(EngineReading)
    done: set[tuple[str, str]] = set()  # (engine, signal) already filled by an earlier rule
    won: list[list[str]] = []
    for rule, (per_engine, _) in zip(dialect.rules, outputs, strict=True):
        stored: list[str] = []
        won.append(stored)
        if per_engine is None:
            continue
        for engine, store in per_engine.items():
            key = (engine, rule.signal)
            # Alternative names: the first rule present wins, except labelled counters,
            # whose rules add disjoint reasons (success + failure counters).
            if key in done and rule.kind is not Kind.LABELLED_COUNTER:
                continue
            done.add(key)
            store(engines[engine])
            stored.append(engine)
    return dict(engines), won


def _patched(dialect: Dialect, outputs: list, rerun: list[int], last: tuple) -> tuple[dict[str, EngineReading], list[list[str]]] | None:
    """:func:`_build`'s result from the last one of this structure, when only plain rules ran again
    and each gave values for the very engines it gave them for last time: then every (engine,
    signal) has the same winning rule, so the last readings (copied) with those rules' values set
    again are what a build gives, in the same order. None otherwise (a build is needed)."""
    last_outputs, last_engines, won = last[1], last[3], last[4]
    for i in rerun:
        new, old = outputs[i][0], last_outputs[i][0]
        if dialect.rules[i].kind not in _PLAIN_KINDS or (new is None) != (old is None):
            return None
        if new is not None and list(new) != list(old):
            return None
    engines = {label: _copied(reading) for label, reading in last_engines.items()}
    for i in rerun:
        per_engine = outputs[i][0]
        for engine in won[i]:
            per_engine[engine](engines[engine])
    return engines, won


def _copied(reading: EngineReading) -> EngineReading:
    """A reading whose parts can be set without touching ``reading`` (labelled parts' inner dicts are
    shared: no plain rule writes into them)."""
    return EngineReading(dict(reading.gauges), dict(reading.labelled_gauges), dict(reading.counters),
                         dict(reading.labelled_counters), dict(reading.histograms), dict(reading.mean_counters))


def _rule_inputs(rule: Rule) -> tuple[str, ...]:
    """Every series name :func:`_apply` may read for ``rule`` (a superset is safe: it only means
    a rule runs again when it need not)."""
    base, alt = rule.canonical, rule.metric.replace(":", "_")
    found = [base + suffix for suffix in _SUFFIXES] + [alt + suffix for suffix in _SUFFIXES]
    if rule.canonical_other:
        found.append(rule.canonical_other)
    return tuple(dict.fromkeys(found))


def _group(rows: Series, rule_match: tuple[tuple[str, str], ...], dialect: Dialect) -> dict[str, Series]:
    out: dict[str, Series] = defaultdict(list)
    for labels, value in rows:
        if _matches(labels, rule_match):
            out[_engine_of(labels, dialect)].append((labels, value))
    return out


def _grouped(parsed: ParsedScrape, name: str, rule_match: tuple[tuple[str, str], ...], dialect: Dialect) -> dict[str, Series]:
    """``_group`` of series ``name``; with a structure memo, which rows go to which engine is
    worked out once per structure (labels do not change with it) and only the rows are picked."""
    rows = parsed.series.get(name) or []
    memo = parsed.memo
    if memo is None:
        return _group(rows, rule_match, dialect)
    key = ("group", name, rule_match, dialect.engine_label)
    plan: dict[str, list[int]] | None = memo.get(key)
    if plan is None:
        plan = {}
        for i, (labels, _) in enumerate(rows):
            if _matches(labels, rule_match):
                plan.setdefault(_engine_of(labels, dialect), []).append(i)
        memo[key] = plan
    return {engine: [rows[i] for i in indices] for engine, indices in plan.items()}


def _bucket_plan(parsed: ParsedScrape, name: str, rule: Rule, dialect: Dialect) -> dict[str, list[tuple[int, float | None]]]:
    """Per engine, ``(row index, scaled le)`` of each bucket row of histogram ``name`` that
    ``rule`` reads, in row order; ``le`` None for a row without a numeric ``le`` (a problem each
    time it is read), rows whose ``le`` is NaN left out. The ``le`` labels belong to the structure,
    so with a structure memo this is worked out once, not on every changed scrape."""
    memo = parsed.memo
    key = ("buckets", name, rule.match, dialect.engine_label, rule.scale)
    if memo is not None and (plan := memo.get(key)) is not None:
        return plan
    rows = parsed.series.get(name) or []
    plan = {}
    for index, (labels, _) in enumerate(rows):
        if not _matches(labels, rule.match):
            continue
        entries = plan.setdefault(_engine_of(labels, dialect), [])
        try:
            le = float(labels["le"])
        except (KeyError, ValueError):
            entries.append((index, None))
            continue
        if math.isnan(le):
            continue
        entries.append((index, le * rule.scale if math.isfinite(le) else le))
    if memo is not None:
        memo[key] = plan
    return plan


def _apply(rule: Rule, parsed: ParsedScrape, dialect: Dialect, problems: list[str]):  # noqa: C901 - one branch per kind
    """``{engine: store(reading)}`` for the engines this rule has data for."""
    name, signal, kind, scale = rule.canonical, rule.signal, rule.kind, rule.scale
    out = {}

    if kind in (Kind.GAUGE, Kind.COUNTER):
        for engine, rows in _grouped(parsed, name, rule.match, dialect).items():
            values = _finite([v for _, v in rows])
            if not values:
                continue
            value = _combine(signal, values) * scale
            target = "gauges" if kind is Kind.GAUGE else "counters"
            out[engine] = lambda r, v=value, t=target: getattr(r, t).__setitem__(signal, v)

    elif kind in (Kind.LABELLED_COUNTER, Kind.LABELLED_GAUGE):
        for engine, rows in _grouped(parsed, name, rule.match, dialect).items():
            labelled: dict[str, float] = defaultdict(float)
            for labels, value in rows:
                if not math.isfinite(value):
                    continue
                reason = rule.fixed_reason or labels.get(rule.source_label or "", "") or "unknown"
                labelled[label_key(reason=_clean_label(reason.lower()))] += value * scale
            if not labelled:
                continue
            target = "labelled_gauges" if kind is Kind.LABELLED_GAUGE else "labelled_counters"

            def store(r, d=dict(labelled), t=target):
                mine = getattr(r, t).setdefault(signal, {})
                for k, v in d.items():
                    mine[k] = mine.get(k, 0.0) + v

            out[engine] = store

    elif kind is Kind.RESPONSE_CLASSES:
        for engine, rows in _grouped(parsed, name, rule.match, dialect).items():
            classes: dict[str, float] = defaultdict(float)
            for labels, value in rows:
                cls = response_class(labels.get(rule.source_label or "status", ""))
                if cls is None or not math.isfinite(value) or labels.get("handler") in UNCOUNTED_HANDLERS:
                    continue
                classes[label_key(**{"class": cls})] += value
            if classes:
                out[engine] = lambda r, d=dict(classes): r.labelled_counters.__setitem__(signal, d)

    elif kind is Kind.HISTOGRAM:
        buckets = _bucket_plan(parsed, name + "_bucket", rule, dialect)
        counts = _grouped(parsed, name + "_count", rule.match, dialect)
        sums = _grouped(parsed, name + "_sum", rule.match, dialect)
        bucket_rows = parsed.series.get(name + "_bucket") or []
        for engine, plan in buckets.items():
            pairs = []
            for index, le in plan:
                if le is None:
                    problems.append(f"{rule.metric}_bucket without a numeric 'le' label")
                else:
                    pairs.append((le, bucket_rows[index][1]))
            if not pairs:
                continue
            count = _finite([v for _, v in counts.get(engine, [])])
            total = _finite([v for _, v in sums.get(engine, [])])
            hist = CumulativeHistogram.build(
                pairs, math.fsum(count) if count else None, math.fsum(total) * scale if total else None
            )
            out[engine] = lambda r, h=hist: r.histograms.__setitem__(signal, h)

    elif kind in (Kind.HISTOGRAM_SUM_COUNTER, Kind.HISTOGRAM_COUNT_COUNTER):
        part, factor = ("_sum", scale) if kind is Kind.HISTOGRAM_SUM_COUNTER else ("_count", 1.0)
        series_name = name + part if parsed.series.get(name + part) else rule.metric.replace(":", "_") + part
        for engine, rows in _grouped(parsed, series_name, rule.match, dialect).items():
            values = _finite([v for _, v in rows])
            if values:
                out[engine] = lambda r, v=math.fsum(values) * factor: r.counters.__setitem__(signal, v)

    elif kind is Kind.MEAN_COUNTERS:
        totals = _grouped(parsed, name, rule.match, dialect)
        counts = _grouped(parsed, rule.canonical_other or "", rule.other_match, dialect)
        for engine, rows in totals.items():
            total = _finite([v for _, v in rows])
            count = _finite([v for _, v in counts.get(engine, [])])
            if total and count:
                pair = (math.fsum(total) * scale, math.fsum(count))
                out[engine] = lambda r, p=pair: r.mean_counters.__setitem__(signal, p)

    elif kind in (Kind.RATIO, Kind.PRODUCT):
        first = _grouped(parsed, name, rule.match, dialect)
        second = _grouped(parsed, rule.canonical_other or "", rule.other_match, dialect)
        for engine, rows in first.items():
            a = _finite([v for _, v in rows])
            b = _finite([v for _, v in second.get(engine, [])])
            if not a or not b:
                continue
            if kind is Kind.RATIO:
                denominator = math.fsum(b)
                if denominator <= 0:
                    continue
                value = math.fsum(a) / denominator
            else:
                value = math.fsum(a) * max(b)
            out[engine] = lambda r, v=value * scale: r.gauges.__setitem__(signal, v)

    elif kind is Kind.INFO_PRODUCT:
        assert rule.labels is not None
        first_label, second_label = rule.labels
        for engine, rows in _grouped(parsed, name, rule.match, dialect).items():
            products = []
            for labels, _ in rows:
                try:
                    products.append(float(int(labels[first_label]) * int(labels[second_label])))
                except (KeyError, ValueError):
                    problems.append(f"{rule.metric}: labels {first_label}/{second_label} missing or not integers")
            if products:
                out[engine] = lambda r, v=math.fsum(products): r.gauges.__setitem__(signal, v)
    return out

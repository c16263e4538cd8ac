"""The exposition cache: a scrape that differs from the last clean one only in its values reuses the
parsed names and labels, and gives exactly what the full parser gives, on every engine fixture."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from engine_http import FIXTURES, SHARED_ENGINES

from llmdiag.collectors import engine_parse
from llmdiag.collectors.engine_parse import ExpositionCache, parse_exposition

SCRAPES = sorted([*FIXTURES.glob("*.prom"), *SHARED_ENGINES.glob("*")], key=lambda p: p.name)


def new_values(text: str) -> str:
    """Every sample's value changed (x3 + 1), names, labels and order kept."""
    out = []
    for line in text.split("\n"):
        head, sep, value = line.rpartition(" ")
        if line and not line.startswith("#") and sep:
            try:
                number = float(value)
            except ValueError:
                number = math.nan
            if math.isfinite(number):
                line = f"{head} {number * 3 + 1!r}"
        out.append(line)
    return "\n".join(out)


def same(a: engine_parse.ParsedScrape, b: engine_parse.ParsedScrape) -> bool:
    return a.series == b.series and a.problems == b.problems and a.lines == b.lines


@pytest.mark.parametrize("path", SCRAPES, ids=lambda p: p.name)
def test_changed_values_skip_the_parser_and_match_a_full_parse(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = path.read_text()
    cache = ExpositionCache()
    assert same(parse_exposition(text, cache), parse_exposition(text))
    assert cache.state is not None, "a clean scrape without timestamps is remembered"
    second = new_values(text)
    expected = parse_exposition(second)
    assert expected.series != parse_exposition(text).series  # the values did change

    def no_parser(*_a: object, **_k: object) -> None:
        raise AssertionError("the full parser ran on a scrape whose structure did not change")

    monkeypatch.setattr(engine_parse, "text_string_to_metric_families", no_parser)
    assert same(parse_exposition(second, cache), expected)


@pytest.mark.parametrize("path", SCRAPES, ids=lambda p: p.name)
def test_a_scrape_read_against_the_last_fast_one_matches_a_full_parse(path: Path) -> None:
    """After one values-only scrape, the next is compared line by line with it: one value moved,
    nothing moved, one line's labels changed, a kept comment changed, a refused value: each gives
    what the full parser gives, and only a values-only scrape keeps the fast path."""
    text = path.read_text()
    cache = ExpositionCache()
    parse_exposition(text, cache)
    second = new_values(text)
    assert same(parse_exposition(second, cache), parse_exposition(second))
    state = cache.state
    lines = second.split("\n")
    at = [i for i, ln in enumerate(lines) if ln and not ln.startswith("#") and " " in ln]
    kept_lines = {index for index, _, _ in state[1]}
    first = next(i for i in at if i in kept_lines)
    one = lines.copy()
    one[first] = one[first].rpartition(" ")[0] + " 12345.5"
    third = "\n".join(one)
    got = parse_exposition(third, cache)
    assert same(got, parse_exposition(third)) and got.memo is not None and cache.state is state
    assert same(parse_exposition(third, cache), parse_exposition(third)) and cache.state is state  # nothing moved
    renamed = one.copy()
    renamed[first] = renamed[first].replace("{", '{zz="1",', 1) if "{" in renamed[first] else "x" + renamed[first]
    fourth = "\n".join(renamed)
    assert same(parse_exposition(fourth, cache), parse_exposition(fourth))
    assert cache.state is not state
    parse_exposition(third, cache)
    parse_exposition(third.replace(" 12345.5", " 7.0", 1), cache)  # a values-only baseline again
    comment = next((i for i, ln in enumerate(one) if ln.startswith("# TYPE ") and i in {c for c, _ in cache.state[3]}), None)
    if comment is not None:
        changed = one.copy()
        changed[comment] = changed[comment].rpartition(" ")[0] + " untyped"
        text_changed = "\n".join(changed)
        assert same(parse_exposition(text_changed, cache), parse_exposition(text_changed))
        parse_exposition(third, cache)
        parse_exposition(third.replace(" 12345.5", " 7.0", 1), cache)
    refused = one.copy()
    refused[first] = refused[first].rpartition(" ")[0] + " 1_0"
    text_refused = "\n".join(refused)
    got = parse_exposition(text_refused, cache)
    assert same(got, parse_exposition(text_refused)) and got.problems


def test_a_changed_structure_or_a_bad_value_goes_through_the_full_parser() -> None:
    text = (FIXTURES / "sglang_documented_text0.0.4.prom").read_text()
    cache = ExpositionCache()
    parse_exposition(text, cache)
    # A new series (another engine label appears): reparsed, and the new structure remembered.
    line = next(ln for ln in text.split("\n") if ln.startswith("sglang:num_running_reqs"))
    grown = text.replace(line, line + "\n" + line.replace("}", ',extra="1"}', 1))
    assert same(parse_exposition(grown, cache), parse_exposition(grown))
    assert cache.state is not None
    assert len(cache.state[1]) == sum(len(rows) for rows in parse_exposition(grown).series.values())
    # A value the exposition parser refuses ("1_0": Python's float() would take it): reported, not read.
    head, _, _ = line.rpartition(" ")
    bad = grown.replace(line + "\n", f"{head} 1_0\n", 1)
    got = parse_exposition(bad, cache)
    assert same(got, parse_exposition(bad)) and got.problems and "1_0" in got.problems[0]
    assert cache.state is None  # a scrape with problems is not a structure to reuse
    # A timestamp on a line: the full parser, every time.
    stamped = text.replace(line, line + " 1700000000000", 1)
    assert same(parse_exposition(stamped, cache), parse_exposition(stamped)) and cache.state is None


@pytest.mark.parametrize("path", SCRAPES, ids=lambda p: p.name)
def test_the_structure_memo_gives_what_a_full_read_gives(path: Path) -> None:
    """read_engines keeps which rows each rule reads per engine in the structure's memo: the
    readings of later scrapes of that structure are those of a full parse and read."""
    from llmdiag.collectors.engine_names import detect_dialect
    from llmdiag.collectors.engine_parse import read_engines

    text = path.read_text()
    cache = ExpositionCache()
    parse_exposition(text, cache)
    if cache.state is None:
        pytest.skip("not a clean scrape: no structure to reuse")
    dialect = detect_dialect(parse_exposition(text).names())
    if dialect is None:
        pytest.skip("no engine dialect")
    second, third = new_values(text), new_values(new_values(text))
    first_fast = parse_exposition(second, cache)
    assert first_fast.memo is not None
    assert read_engines(first_fast, dialect) == read_engines(parse_exposition(second), dialect)
    assert any(key[0] == "group" for key in first_fast.memo if isinstance(key, tuple))  # filled now
    again = parse_exposition(third, cache)
    assert again.memo is first_fast.memo
    assert read_engines(again, dialect) == read_engines(parse_exposition(third), dialect)


@pytest.mark.parametrize("path", SCRAPES, ids=lambda p: p.name)
def test_readings_patched_from_the_last_ones_are_those_of_a_full_read(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """When only plain rules (gauges, counters, histograms...) ran again and gave values for the same
    engines, read_engines patches copies of the last readings instead of building them: each line
    changed alone, one after the other, must still read as a full parse does, key order included."""
    from llmdiag.collectors.engine_names import detect_dialect
    from llmdiag.collectors.engine_parse import read_engines

    text = path.read_text()
    cache = ExpositionCache()
    parse_exposition(text, cache)
    dialect = detect_dialect(parse_exposition(text).names())
    if cache.state is None or dialect is None:
        pytest.skip("no structure to reuse or no engine dialect")
    patched = []
    real = engine_parse._patched

    def counting(*args: object) -> object:
        got = real(*args)  # type: ignore[arg-type]
        patched.append(got is not None)
        return got

    monkeypatch.setattr(engine_parse, "_patched", counting)
    lines = new_values(text).split("\n")
    read_engines(parse_exposition("\n".join(lines), cache), dialect)
    slots = [index for index, _, _ in cache.state[1]]
    for step, index in enumerate(slots[:60]):
        lines[index] = lines[index].rpartition(" ")[0] + f" {step + 0.5!r}"
        body = "\n".join(lines)
        fast, full = read_engines(parse_exposition(body, cache), dialect), read_engines(parse_exposition(body), dialect)
        assert fast == full, lines[index]
        assert [list(vars_of(r)) for r in fast.engines.values()] == [list(vars_of(r)) for r in full.engines.values()]
    assert any(patched) or not slots


def vars_of(reading: engine_parse.EngineReading) -> list:
    """Every part of a reading with its keys in order (dataclass == ignores dict order)."""
    return [(name, list(getattr(reading, name).items())) for name in
            ("gauges", "labelled_gauges", "counters", "labelled_counters", "histograms", "mean_counters")]


def test_a_line_that_becomes_wanted_or_a_changed_type_line_goes_through_the_full_parser(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fast path compares every line's head, not only the kept lines: a dropped line (``process_*``)
    that now names a wanted series, or a wanted family's ``# TYPE`` that changed, is not a
    values-only change."""
    text = (SHARED_ENGINES / "vllm_v1_real_scrape_0.9era.prom").read_text()
    lines = text.split("\n")
    dropped = next(i for i, ln in enumerate(lines) if ln.startswith("process_") and not ln.startswith("#"))
    typed = next(i for i, ln in enumerate(lines) if ln.startswith("# TYPE vllm:num_requests_waiting "))
    became_wanted = lines.copy()
    became_wanted[dropped] = 'vllm:num_requests_waiting{engine="9",model_name="m"} 7.0'
    retyped = lines.copy()
    retyped[typed] = lines[typed].rsplit(" ", 1)[0] + " untyped"
    for changed in ("\n".join(became_wanted), "\n".join(retyped)):
        cache = ExpositionCache()
        parse_exposition(text, cache)
        assert cache.state is not None
        full_runs = []
        real = engine_parse.text_string_to_metric_families

        def counting(*args: object, **kwargs: object):  # noqa: ANN202
            full_runs.append(1)
            return real(*args, **kwargs)

        monkeypatch.setattr(engine_parse, "text_string_to_metric_families", counting)
        got = parse_exposition(changed, cache)
        monkeypatch.setattr(engine_parse, "text_string_to_metric_families", real)
        assert full_runs, "the full parser must read a scrape whose structure changed"
        assert same(got, parse_exposition(changed))
    # The extra engine's waiting count is read, as the full parse reads it.
    rows = parse_exposition("\n".join(became_wanted), ExpositionCache()).series["vllm_num_requests_waiting"]
    assert ({"engine": "9", "model_name": "m"}, 7.0) in rows


def test_rules_whose_rows_did_not_move_are_not_applied_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A later scrape of the same structure: only the rules reading a changed series run again,
    and the reading is the full one."""
    from llmdiag.collectors.engine_names import detect_dialect
    from llmdiag.collectors.engine_parse import read_engines

    text = (SHARED_ENGINES / "vllm_v1_real_scrape_0.9era.prom").read_text()
    cache = ExpositionCache()
    parse_exposition(text, cache)
    dialect = detect_dialect(parse_exposition(text).names())
    waiting = next(ln for ln in text.split("\n") if ln.startswith("vllm:num_requests_waiting{"))
    moved = text.replace(waiting, waiting.rpartition(" ")[0] + " 42.0")
    applied: list[str] = []
    real_apply = engine_parse._apply

    def counting(rule, *args):  # noqa: ANN001, ANN202
        applied.append(rule.signal)
        return real_apply(rule, *args)

    monkeypatch.setattr(engine_parse, "_apply", counting)
    read_engines(parse_exposition(text, cache), dialect)  # the first fast-path read: every rule
    everything = len(applied)
    applied.clear()
    got = read_engines(parse_exposition(moved, cache), dialect)
    assert applied == ["requests_waiting"] and everything > 10
    assert got == read_engines(parse_exposition(moved), dialect)
    assert got.engines["0"].gauges["requests_waiting"] == 42.0

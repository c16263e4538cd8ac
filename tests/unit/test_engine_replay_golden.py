"""The engine collector's whole output over recorded real scrapes, pinned value for value.

``tests/fixtures/engine_scrapes/fleet.jsonl.gz`` holds 32 consecutive ``/metrics`` bodies of three
``llmdiag fake-engine`` processes under light load (``record.py`` next to it): one crashes, is
refused for three scrapes and restarts with its counters at zero; the load stops after 22 scrapes,
so the last ones repeat the previous body byte for byte; a fourth backend is two engines' bodies
merged into one data-parallel scrape. Three scrapes are damaged here on purpose (:func:`_damaged`). Every sample the collector returns (scope, subject, name,
engine, value with its exact type and float bits, labelled values in their order), each
backend's problems and the collector status are compared with ``engine_golden.json.gz``, written
by the collector as it was before its hot path was reworked for CPU (issue 13). Regenerate it
only for an intended change of output: ``LLMDIAG_WRITE_GOLDEN=1 pytest this file``.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

from llmdiag.collectors.engine import EngineCollector
from llmdiag.collectors.http_fetch import FetchResult
from llmdiag.model import Backend, Distribution

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "engine_scrapes"
GOLDEN = FIXTURES / "engine_golden.json.gz"
NAMES = ("a", "b", "c", "dp")


def _value(value: object) -> object:
    """A JSON form that tells 1 from 1.0 and keeps every float bit (repr) and the key order."""
    if value is None:
        return None
    if isinstance(value, Distribution):
        return ["dist", [_value(v) for v in (value.p50, value.p99, value.ewma, value.count)]]
    if isinstance(value, dict):
        return ["labelled", [[key, _value(number)] for key, number in value.items()]]
    return [type(value).__name__, repr(value)]


def _damaged(tick: int, name: str, body: str) -> str:
    """A few scrapes made degraded on purpose: a malformed line (b, tick 9), a value the
    exposition parser refuses (c, tick 10: ``1_0``), a NaN gauge (b, tick 26, while idle)."""
    lines = body.split("\n")
    at = next(i for i, line in enumerate(lines) if line.startswith("vllm:num_requests_waiting"))
    if (tick, name) == (9, "b"):
        lines.insert(at + 1, 'vllm:num_requests_waiting{engine="0" this is not a sample')
    elif (tick, name) == (10, "c"):
        lines[at] = lines[at].rpartition(" ")[0] + " 1_0"
    elif (tick, name) == (26, "b"):
        lines[at] = lines[at].rpartition(" ")[0] + " NaN"
    return "\n".join(lines)


def _replay() -> list[dict]:
    rows = [json.loads(line) for line in gzip.open(FIXTURES / "fleet.jsonl.gz", "rt")]
    ticks = max(row["tick"] for row in rows) + 1
    by_tick = {(row["tick"], row["backend"]): row for row in rows}
    backends = [Backend.from_url(f"http://127.0.0.1:{9100 + i}", name=name) for i, name in enumerate(NAMES)]
    by_url = {f"http://127.0.0.1:{9100 + i}/metrics": name for i, name in enumerate(NAMES)}
    now = {"tick": 0}

    def fetch(url: str, timeout: float, max_bytes: int, accept: str) -> FetchResult:
        row = by_tick.get((now["tick"], by_url[url]))
        if row is None:
            return FetchResult(url=url, error="connection refused", failure="connection_refused", elapsed_seconds=0.001)
        if "body" not in row:
            return FetchResult(url=url, error=row["error"], failure=row["failure"], elapsed_seconds=0.001)
        return FetchResult(url=url, status=row["status"], body=_damaged(now["tick"], by_url[url], row["body"]), elapsed_seconds=0.002)

    collector = EngineCollector(backends, fetch=fetch, clock=lambda: 1000.0 + now["tick"])
    out = []
    try:
        for tick in range(ticks):
            now["tick"] = tick
            samples = collector.collect(1000.0 + tick)
            status = collector.status()
            out.append({
                "tick": tick,
                "samples": [[s.scope.value, s.subject, s.name, s.engine, _value(s.value)] for s in samples],
                "problems": {name: list(scrape.problems) for name, scrape in collector.results.items()},
                "status": [status.status.value, status.reason, status.errors_total],
            })
    finally:
        collector.close()
    return out


def test_replay_matches_the_golden_output() -> None:
    got = _replay()
    if os.environ.get("LLMDIAG_WRITE_GOLDEN") == "1":
        with gzip.open(GOLDEN, "wt") as out:
            json.dump(got, out, indent=0)
    want = json.load(gzip.open(GOLDEN, "rt"))
    assert len(got) == len(want)
    for mine, theirs in zip(got, want, strict=True):
        assert mine == theirs, f"tick {mine['tick']} differs"


def test_the_recording_covers_what_the_golden_is_for() -> None:
    """Restart, refused scrapes, idle repeats and a data-parallel backend are all in the replay."""
    got = _replay()
    problems = [p for tick in got for ps in tick["problems"].values() for p in ps]
    assert any("counter reset" in p for p in problems)
    assert any(p.startswith("line ") for p in got[9]["problems"]["b"])
    assert got[10]["problems"]["c"]
    downs = [s for tick in got for s in tick["samples"] if s[2] == "up" and s[4] == ["int", "0"]]
    assert downs and all(s[1] == "a" for s in downs)
    assert {s[3] for tick in got for s in tick["samples"] if s[1] == "dp" and s[3] is not None} == {"0", "1"}
    last, previous = got[-1]["samples"], got[-2]["samples"]
    assert [s for s in last if s[2] != "scrape_age_seconds"] == [s for s in previous if s[2] != "scrape_age_seconds"]

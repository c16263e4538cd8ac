"""The analysis side's full output, tick by tick, against a golden file recorded before its cost work.

Every timeline scenario (``llmdiag.analyzers.timelines.SCENARIOS``) and a slice of a real
recording (``tests/fixtures/recordings/fleet_crash_stall.jsonl.gz``: 4 of 16 fake vLLM engines
scraped by every collector, one stalling and one crashing and restarting; see
tests/fixtures/recordings/README.md) go through an :class:`AgentLoop`. For every tick the test
keeps what a user or a gateway can see: the diagnoses opened, closed and open (kind, subject,
severity, confidence, since, summary, every piece of evidence, penalty), each backend's health,
and the ``/v1/penalties`` document (scores, weights, states, reasons). Ticks that repeat the
previous tick's output are left out of the file, so the file is the stream of changes.

The golden file was written by the code before the analysis was made cheaper (lazy evidence,
compact windows, cached documents): the same input must give exactly the same output, to the
last digit. ``LLMDIAG_UPDATE_GOLDEN=1`` rewrites it; review the diff before committing one.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Any

import pytest

from llmdiag.agent.loop import AgentLoop
from llmdiag.analyzers.timelines import SCENARIOS
from llmdiag.config import Config
from llmdiag.model import Backend, Snapshot, read_snapshots

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "analysis_stream.json.gz"
RECORDING = Path(__file__).resolve().parents[1] / "fixtures" / "recordings" / "fleet_crash_stall.jsonl.gz"


def _tick(loop: AgentLoop, snap: Snapshot) -> dict[str, Any]:
    state = loop.observe(snap)
    result = loop.last_result
    assert result is not None
    return {
        "opened": [d.to_json() for d in result.opened],
        "closed": [d.to_json() for d in result.closed],
        "open": [d.to_json() for d in result.open],
        "health": {name: [h.penalty, h.state.value, [r.to_json() for r in h.reasons]]
                   for name, h in sorted(result.backends.items())},
        "penalties": state.penalties(5).to_json(),
        "closed_kept": [e.to_json() for e in state.closed],
    }


def _stream(loop: AgentLoop, snapshots: list[Snapshot]) -> list[dict[str, Any]]:
    """The ticks whose output differs from the tick before (with their index)."""
    out: list[dict[str, Any]] = []
    previous: str | None = None
    for i, snap in enumerate(snapshots):
        record = _tick(loop, snap)
        text = json.dumps({k: v for k, v in record.items() if k != "penalties"} | {
            "penalties": {k: v for k, v in record["penalties"].items() if k != "ts"}}, sort_keys=True)
        if text != previous:
            out.append({"tick": i, **record})
        previous = text
    return out


def _scenario_stream(name: str) -> list[dict[str, Any]]:
    timeline = SCENARIOS[name].build()
    return _stream(AgentLoop(Config(), timeline.backends()), timeline.snapshots)


def _recording_stream() -> list[dict[str, Any]]:
    snapshots = list(read_snapshots(RECORDING))
    backends = [Backend(name, f"http://{name}") for name in sorted(snapshots[0].backends)]
    return _stream(AgentLoop(Config(), backends), snapshots)


def _all_streams() -> dict[str, list[dict[str, Any]]]:
    streams = {name: _scenario_stream(name) for name in sorted(SCENARIOS)}
    streams["recording:fleet_crash_stall"] = _recording_stream()
    return streams


def _roundtrip(obj: Any) -> Any:
    """What the golden file holds: JSON (tuples become lists, floats keep every digit)."""
    return json.loads(json.dumps(obj))


@pytest.fixture(scope="module")
def golden() -> dict[str, list[dict[str, Any]]]:
    if os.environ.get("LLMDIAG_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(GOLDEN, "wt") as fh:
            json.dump(_all_streams(), fh, sort_keys=True, separators=(",", ":"))
    assert GOLDEN.exists(), f"missing {GOLDEN}; run with LLMDIAG_UPDATE_GOLDEN=1 on the reference code once"
    with gzip.open(GOLDEN, "rt") as fh:
        return json.load(fh)


def _first_difference(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> str:
    for g, w in zip(got, want):
        if g != w:
            keys = [k for k in w if g.get(k) != w.get(k)]
            return f"tick {w.get('tick')}: {keys} differ: got {json.dumps({k: g.get(k) for k in keys})[:1500]} " \
                   f"want {json.dumps({k: w.get(k) for k in keys})[:1500]}"
    return f"{len(got)} changes, want {len(want)}"


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_scenario_output_is_unchanged(name: str, golden: dict[str, list[dict[str, Any]]]) -> None:
    got = _roundtrip(_scenario_stream(name))
    want = golden[name]
    assert got == want, _first_difference(got, want)


def test_recorded_fleet_output_is_unchanged(golden: dict[str, list[dict[str, Any]]]) -> None:
    got = _roundtrip(_recording_stream())
    want = golden["recording:fleet_crash_stall"]
    # The slice holds a stall and a crash: the stream must have seen both open and close.
    kinds = {d["kind"] for change in want for d in change["opened"]}
    assert {"engine_stalled", "backend_down"} <= kinds, kinds
    assert got == want, _first_difference(got, want)

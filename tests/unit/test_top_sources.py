"""The data sources behind ``llmdiag top``: replay controls, closing, and a remote agent's /v1/state."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from llmdiag.agent.loop import AgentLoop
from llmdiag.agent.sources import AgentSource, LiveSource, ReplaySource, diagnosis_changes
from llmdiag.config import Config
from llmdiag.model import Snapshot

from tui_support import SteppingClock, fleet_backends, fleet_timeline


def test_replay_delivers_every_tick_and_the_same_diagnoses_as_the_agent_loop() -> None:
    snapshots = fleet_timeline()
    source = ReplaySource(Config(), snapshots, backends=fleet_backends(), monotonic=SteppingClock())
    reference = AgentLoop(Config(), fleet_backends())
    previous = None
    opened = []
    for snap in snapshots:
        state = source.read()
        assert state is not None and state.ts == snap.ts
        expected = reference.observe(snap)
        assert [d.kind for d in state.open] == [d.kind for d in expected.open]
        opened += diagnosis_changes(previous, state)[0]
        previous = state
    assert source.read() is None
    assert {(d.backend, d.kind) for d in opened} >= {("vllm-1", "kv_cache_saturation"),
                                                    ("vllm-3", "timewait_exhaustion")}


def test_replay_is_paced_by_the_recorded_timestamps_and_speed() -> None:
    now = [0.0]
    waits: list[float] = []
    source = ReplaySource(Config(), fleet_timeline()[:3], speed=4.0, monotonic=lambda: now[0])
    # Condition.wait returns on timeout; make time pass as it is asked to.
    original = source._cond.wait

    def wait(timeout: float | None = None) -> bool:
        waits.append(timeout or 0.0)
        now[0] += timeout or 0.0
        return original(0)

    source._cond.wait = wait  # type: ignore[method-assign]
    assert source.read() is not None and waits == []  # the first tick at once
    assert source.read() is not None
    assert sum(waits) == pytest.approx(0.25)  # 1 s of recording at 4x
    assert source.set_speed(1000) == ReplaySource.MAX_SPEED
    assert source.set_speed(0) == ReplaySource.MIN_SPEED


def test_closing_wakes_a_paused_replay_and_a_sleeping_live_source() -> None:
    replay = ReplaySource(Config(), fleet_timeline(), paused=True)
    result: list[object] = []
    reader = threading.Thread(target=lambda: result.append(replay.read()))
    reader.start()
    replay.close()
    reader.join(5)
    assert not reader.is_alive() and result == [None]

    closed = []

    def ticks(sleep) -> Iterator[Snapshot]:  # type: ignore[no-untyped-def]
        try:
            for snap in fleet_timeline():
                yield snap
                sleep(3600)  # an hour between ticks: only close() can cut this short
        finally:
            closed.append(True)

    stopped = []
    live = LiveSource(Config(), fleet_backends(), ticks, on_close=lambda: stopped.append(True))
    assert live.read() is not None
    reader = threading.Thread(target=lambda: result.append(live.read()))
    reader.start()
    live.close()
    reader.join(5)
    assert not reader.is_alive() and result[-1] is None
    assert closed == [True] and stopped == [True]  # generator closed (collectors), on_close ran once
    live.close()
    assert stopped == [True]


class _Agent(BaseHTTPRequestHandler):
    body = b""
    status = 200
    seen_auth: list[str | None] = []

    def do_GET(self) -> None:  # noqa: N802
        type(self).seen_auth.append(self.headers.get("Authorization"))
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


def test_agent_source_reads_v1_state_and_reports_a_broken_agent() -> None:
    loop = AgentLoop(Config(), fleet_backends())
    for snap in fleet_timeline():
        state = loop.observe(snap)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Agent)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        _Agent.body = json.dumps(state.to_json()).encode()
        source = AgentSource(url, interval=0.05, token="s3cret")
        got = source.fetch()
        assert got.ts == state.ts and {d.kind for d in got.open} == {d.kind for d in state.open}
        assert _Agent.seen_auth[-1] == "Bearer s3cret"
        assert source.read() is not None and source.error is None
        _Agent.body = b"not json"
        with pytest.raises(ValueError, match="did not answer JSON"):
            source.fetch()
        _Agent.body = json.dumps({"schema": "something/else"}).encode()
        with pytest.raises(ValueError, match="llmdiag.state/v1"):
            source.fetch()
        # read() keeps trying and says why; close() ends it.
        result: list[object] = []
        reader = threading.Thread(target=lambda: result.append(source.read()))
        reader.start()
        for _ in range(100):
            if source.error:
                break
            threading.Event().wait(0.02)
        assert source.error and "llmdiag.state/v1" in source.error
        source.close()
        reader.join(5)
        assert result == [None]
    finally:
        server.shutdown()
    with pytest.raises(ValueError, match="http"):
        AgentSource("localhost:9100")

"""Bodies built once per tick: ``/metrics``, ``/v1/penalties`` and ``/v1/state`` follow the state, never lag it."""

from __future__ import annotations

import asyncio
import dataclasses
import json

from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from llmdiag.agent.daemon import Agent
from llmdiag.agent.http import PerState, build_app
from llmdiag.agent.loop import AgentLoop
from llmdiag.analyzers.timelines import SCENARIOS
from llmdiag.config import Config
from llmdiag.exporters.prometheus import AgentTelemetry, LiveCollector, TickExposition

CONFIG = Config.from_toml('[agent]\ndiscover = false\ncollectors = ["proc"]\nprobes = false\n')


def _values(text: bytes, name: str) -> dict[str, float]:
    for fam in text_string_to_metric_families(text.decode()):
        for s in fam.samples:
            if s.name == name:
                return {**s.labels, "value": s.value}
    raise AssertionError(f"{name} not in the exposition")


def _fleet():
    timeline = SCENARIOS["kv_cache_saturation"].build()
    return timeline.backends(), timeline.snapshots


def test_metrics_render_once_per_tick_and_change_with_the_next_tick() -> None:
    backends, snaps = _fleet()
    loop = AgentLoop(Config(), backends)
    telemetry = [AgentTelemetry(ticks_total=0)]
    live = {"unauthorized": 0}
    registry = CollectorRegistry(auto_describe=False)
    registry.register(LiveCollector(lambda: AgentTelemetry(http_unauthorized_total=live["unauthorized"])))
    exposition = TickExposition(lambda: (loop.state, telemetry[0]), registry)

    def tick(snap) -> None:
        loop.observe(snap)
        telemetry[0] = dataclasses.replace(telemetry[0], ticks_total=telemetry[0].ticks_total + 1)

    for snap in snaps[:-1]:
        tick(snap)
    first = exposition.render()
    assert exposition.render() == first and exposition.renders == 1  # the second scrape of a tick costs no render
    live["unauthorized"] = 3  # moves between ticks: seen at once, without a new render of the tick
    again = exposition.render()
    assert _values(again, "llmdiag_http_unauthorized_total")["value"] == 3.0 and exposition.renders == 1
    tick(snaps[-1])
    after = exposition.render()
    assert exposition.renders == 2
    assert _values(first, "llmdiag_ticks_total")["value"] + 1 == _values(after, "llmdiag_ticks_total")["value"]
    kv = [s.value for f in text_string_to_metric_families(after.decode()) for s in f.samples
          if s.name == "llmdiag_backend_kv_cache_usage"]
    assert kv, "the new tick's signals are in the new body"
    names = [f.name for f in text_string_to_metric_families(after.decode())]
    assert len(names) == len(set(names)), "no family twice (the tick and the live parts are disjoint)"


def test_per_state_body_is_built_once_per_state() -> None:
    built: list[object] = []
    body = PerState(lambda s: (built.append(s), f"body of {s['n']}")[1])
    a, b = {"n": 1}, {"n": 1}  # equal, not the same: a new tick with the same content is a new state
    assert body.get(a) == body.get(a) == "body of 1" and built == [a]
    assert body.get(b) == "body of 1" and built == [a, b] and body.builds == 2


def test_http_bodies_follow_the_published_state() -> None:
    backends, snaps = _fleet()
    agent = Agent(CONFIG, backends=backends)

    async def go() -> None:
        client = TestClient(TestServer(build_app(agent, agent.exposition, None)))
        await client.start_server()
        try:
            for snap in snaps[:-1]:
                agent.loop.observe(snap)
            seen = {}
            for path in ("/v1/penalties", "/v1/state"):  # (/metrics holds the process's CPU time: it moves)
                r1 = await client.get(path)
                r2 = await client.get(path)
                seen[path] = await r1.read()
                assert r1.status == r2.status == 200 and seen[path] == await r2.read()
            agent.loop.observe(snaps[-1])
            pen = json.loads(await (await client.get("/v1/penalties")).read())
            state = json.loads(await (await client.get("/v1/state")).read())
            assert pen["ts"] == state["ts"] == snaps[-1].ts != json.loads(seen["/v1/penalties"])["ts"]
            assert state["ticks"] == json.loads(seen["/v1/state"])["ticks"] + 1
            assert pen == agent.state.penalties(CONFIG.agent.penalties_ttl_seconds).to_json()
        finally:
            await client.close()

    asyncio.run(go())


def test_bpf_program_statistics_are_read_per_scrape_not_per_tick(monkeypatch) -> None:
    from llmdiag.agent import bpf_stats

    backends, snaps = _fleet()
    agent = Agent(CONFIG, backends=backends)
    reads: list[int] = []

    def stats(collectors, proc_root="/proc"):
        reads.append(1)
        return {"tcp/trace_connect": 0.25 * len(reads)}, {"tcp/trace_connect": 10 * len(reads)}

    monkeypatch.setattr(bpf_stats, "program_stats", stats)
    agent.loop.observe(snaps[0])
    first = agent.exposition.render()
    second = agent.exposition.render()
    assert len(reads) == 2 and agent.exposition.renders == 1
    assert _values(first, "llmdiag_bpf_run_count_total")["value"] == 10.0
    assert _values(second, "llmdiag_bpf_run_time_seconds_total")["value"] == 0.5


def test_a_failing_bpf_statistics_read_never_breaks_the_scrape(monkeypatch) -> None:
    from llmdiag.agent import bpf_stats

    backends, snaps = _fleet()
    agent = Agent(CONFIG, backends=backends)

    def broken(collectors, proc_root="/proc"):
        raise RuntimeError("program closed under us")

    monkeypatch.setattr(bpf_stats, "program_stats", broken)
    agent.loop.observe(snaps[0])
    text = agent.exposition.render().decode()
    assert "llmdiag_backend_score" in text and "llmdiag_bpf_run_count_total{" not in text

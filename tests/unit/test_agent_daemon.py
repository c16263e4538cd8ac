"""The agent object without its servers: /healthz logic, backend info labels, run-time backend changes."""

from __future__ import annotations

import concurrent.futures
import time

from llmdiag.agent.daemon import STARTUP_GRACE_SECONDS, Agent
from llmdiag.config import Config
from llmdiag.model import Backend

CONFIG = Config.from_toml('[agent]\ndiscover = false\ncollectors = ["proc"]\nprobes = false\n')


def test_healthz_says_why() -> None:
    agent = Agent(CONFIG, backends=[])
    ok, why = agent.health()
    assert ok and why.startswith("starting")
    agent._started -= STARTUP_GRACE_SECONDS + 1  # as if the collectors had been building for too long
    ok, why = agent.health()
    assert not ok and "still building" in why
    agent._built_mono = time.monotonic() - 0.1
    assert agent.health() == (True, "starting: first tick")
    agent._built_mono = time.monotonic() - CONFIG.agent.stale_after_seconds - 1
    ok, why = agent.health()
    assert not ok and "first tick has not finished" in why
    agent._last_tick_mono = time.monotonic() - 0.5
    ok, why = agent.health()
    assert ok and why.startswith("ok: last tick")
    agent._last_tick_mono = time.monotonic() - CONFIG.agent.stale_after_seconds - 1
    ok, why = agent.health()
    assert not ok and why.startswith("tick loop stuck: last tick")
    agent.fatal = "collectors failed to start: boom"
    assert agent.health() == (False, "agent failed: collectors failed to start: boom")


def test_backend_info_carries_kubernetes_labels() -> None:
    labelled = Backend.from_url("http://10.244.7.21:8000", name="vllm-a", engine="vllm",
                                labels={"pod": "vllm-a-0", "namespace": "llm", "container": "vllm", "node": "gpu-7"})
    agent = Agent(CONFIG, backends=[labelled, Backend.from_url("http://127.0.0.1:9000", name="plain")])
    text = agent.exposition.render().decode()
    assert ('llmdiag_backend_info{address="10.244.7.21:8000",backend="vllm-a",container="vllm",engine="vllm",'
            'namespace="llm",node="gpu-7",pod="vllm-a-0"} 1.0') in text
    assert 'llmdiag_backend_info{address="127.0.0.1:9000",backend="plain",container="",engine="",' in text
    assert "process_resident_memory_bytes" in text


def _resolved(backends: list[Backend]) -> concurrent.futures.Future[list[Backend]]:
    future: concurrent.futures.Future[list[Backend]] = concurrent.futures.Future()
    future.set_result(backends)
    return future


def test_backend_changes_are_applied() -> None:
    a = Backend.from_url("http://127.0.0.1:8000", name="a", pid=100)
    agent = Agent(CONFIG, backends=[a])
    b = Backend.from_url("http://127.0.0.1:8001", name="b")
    agent._apply_backends(_resolved([a, b]))  # a new engine
    assert [x.name for x in agent.backends] == ["a", "b"]
    assert {x.name for x in agent.loop.balancer.backends} == {"a", "b"}
    assert [i.backend for i in agent._telemetry.backends] == ["a", "b"]
    restarted = Backend.from_url("http://127.0.0.1:8000", name="a", pid=200)
    agent._apply_backends(_resolved([restarted]))  # a new pid; b is kept though not found this time
    assert [(x.name, x.pid) for x in agent.backends] == [("a", 200), ("b", None)]
    assert agent.loop.balancer.state("a").value == "warming"


def test_state_json_never_fails_on_a_non_finite_number() -> None:
    from llmdiag.agent.http import _dumps

    assert _dumps({"a": [1.0, float("inf")], "b": {"c": float("nan")}, "d": "x"}) == '{"a":[1.0,null],"b":{"c":null},"d":"x"}'


def test_backend_info_takes_the_engine_detected_by_the_first_scrape() -> None:
    from engine_http import FIXTURES, metrics_server

    from llmdiag.agent.wiring import build_collectors

    body = (FIXTURES / "sglang_documented_text0.0.4.prom").read_text()
    with metrics_server(body) as server:
        given = Backend.from_url(server.url, name="sgl")  # --backend URL: no engine given
        agent = Agent(CONFIG, backends=[given])
        assert 'engine=""' in agent.exposition.render().decode()
        agent._collectors, unavailable = build_collectors(CONFIG, agent.backends, ["engine"])
        agent._collect_pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
        try:
            assert not unavailable
            agent._tick({})
        finally:
            agent._collect_pool.shutdown(wait=True)
            for c in agent._collectors:
                c.close()
    assert agent.state.snapshot is not None and agent.state.snapshot.backends["sgl"]["up"] == 1
    text = agent.exposition.render().decode()
    assert 'llmdiag_backend_info{address="127.0.0.1:%d",backend="sgl",container="",engine="sglang",' % server.port in text
    assert agent.backends[0].engine is None  # the given backend is left as it was


def test_compiler_memory_is_released_only_with_bcc_loaded_and_unless_turned_off(monkeypatch) -> None:
    import sys

    from llmdiag.agent import daemon
    from llmdiag.bpf.memory import Released

    done = Released(100, 60, 90, 10, True, 4, "pageout")
    calls: list[int] = []
    monkeypatch.setattr(daemon, "release_compiler_memory", lambda: calls.append(1) or done)
    monkeypatch.delitem(sys.modules, "bcc", raising=False)
    agent = Agent(CONFIG, backends=[])
    agent._release_compiler_memory()
    assert calls == [] and agent.compiler_memory is None  # no BPF program was compiled: nothing to give back
    monkeypatch.setitem(sys.modules, "bcc", object())
    agent._release_compiler_memory()
    assert calls == [1] and agent.compiler_memory is done
    off = Agent(Config.from_toml('[agent]\ndiscover = false\ncollectors = ["proc"]\nprobes = false\n'
                                 "release_compiler_memory = false\n"), backends=[])
    off._release_compiler_memory()
    assert calls == [1] and off.compiler_memory is None

    def broken() -> Released:
        raise OSError("no /proc")

    monkeypatch.setattr(daemon, "release_compiler_memory", broken)
    agent._release_compiler_memory()  # logged, never raised: the agent keeps running


def test_startup_heap_is_frozen_only_when_asked() -> None:
    import gc

    plain = Agent(CONFIG, backends=[])
    plain._freeze_startup_heap()
    assert plain.frozen_objects == 0 and gc.get_freeze_count() == 0  # in-process users keep their GC as it was
    agent = Agent(CONFIG, backends=[], freeze_heap=True)
    try:
        agent._freeze_startup_heap()
        assert agent.frozen_objects == gc.get_freeze_count() > 1000  # the interpreter's and the agent's objects
        assert len(gc.get_objects()) < agent.frozen_objects  # a collection now walks only what came after
    finally:
        gc.unfreeze()

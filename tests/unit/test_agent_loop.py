"""``AgentLoop``: analyzer -> balancer -> immutable ``AgentState``; the ``llmdiag.state/v1`` round trip."""

from __future__ import annotations

import json

import pytest

from llmdiag.agent import AgentLoop, AgentState, analyze
from llmdiag.agent.loop import STATE_SCHEMA, AgentBackend
from llmdiag.analyzers import Analyzer
from llmdiag.analyzers.timelines import SCENARIOS, TimelineBuilder
from llmdiag.config import Config
from llmdiag.model import BackendState, PenaltiesDocument


def _run(name: str, keep_closed: int = 100) -> tuple[AgentLoop, list[AgentState]]:
    t = SCENARIOS[name].build()
    loop = AgentLoop(Config(), t.backends(), keep_closed=keep_closed)
    return loop, [loop.observe(s, collect_seconds=0.002) for s in t.snapshots]


def test_each_tick_publishes_a_new_state_and_feeds_the_balancer() -> None:
    loop, states = _run("kv_cache_saturation")
    assert len({id(s) for s in states}) == len(states)  # swapped by reference, never mutated in place
    assert loop.state is states[-1]
    last = states[-1]
    assert last.ticks == len(states)
    assert last.last_tick_seconds is not None and last.last_tick_seconds >= 0.002
    assert [d.kind for d in last.open if d.backend == "vllm-0"] == ["kv_cache_saturation"]
    bad, good = last.backends["vllm-0"], last.backends["vllm-1"]
    assert bad.penalty == pytest.approx(0.5)
    assert bad.reasons[0].kind == "kv_cache_saturation"
    # The balancer's score carries the penalty: the faulty backend weighs less than the healthy one.
    assert bad.score < good.score and bad.weight_percent < good.weight_percent
    assert loop.balancer.score("vllm-0") == pytest.approx(bad.score, abs=0.5)
    assert last.snapshot is not None and set(last.snapshot.backends) == {"vllm-0", "vllm-1"}
    assert set(last.collectors) == set(last.snapshot.collectors)


def test_state_round_trips_exactly_through_json() -> None:
    _, states = _run("queue_avalanche")
    for state in (states[0], states[len(states) // 2], states[-1]):
        text = json.dumps(state.to_json(), allow_nan=False)
        back = AgentState.from_json(json.loads(text))
        assert back == state
        assert back.to_json() == state.to_json()
    assert states[-1].to_json()["schema"] == STATE_SCHEMA


def _fault_and_recovery(times: int) -> TimelineBuilder:
    t = TimelineBuilder(["vllm-0", "vllm-1"]).advance(40)
    for _ in range(times):
        t.backend("vllm-0").set(kv_cache_usage=0.97, requests_waiting=4.0).rate("preemptions_total", 0.5)
        t.advance(15)
        t.backend("vllm-0").set(kv_cache_usage=0.3, requests_waiting=0.0).rate("preemptions_total", 0.0)
        t.advance(60)
    return t


def test_closed_episodes_are_kept_up_to_the_bound() -> None:
    t = _fault_and_recovery(2)
    loop = AgentLoop(Config(), t.backends(), keep_closed=1)
    states = [loop.observe(s) for s in t.snapshots]
    closes = sum(len(loop.analyzer.observe(s).closed) for s in t.snapshots[-1:])  # idempotent re-observe
    assert closes == 0
    closed_seen = {(e.diagnosis.kind, e.diagnosis.since) for s in states for e in s.closed}
    assert len(closed_seen) >= 2, "the timeline opens and closes kv_cache_saturation twice"
    assert all(len(s.closed) <= 1 for s in states)
    assert all(e.closed_at is not None and not e.to_json()["open"] for s in states for e in s.closed)
    assert not [d for d in states[-1].open if d.backend == "vllm-0"]
    # After recovery the warm-up ramp brings the score back up with tick time.
    assert states[-1].backends["vllm-0"].score > 90


def test_penalties_document_of_a_state() -> None:
    _, states = _run("kv_cache_saturation")
    doc = states[-1].penalties(ttl_seconds=3)
    back = PenaltiesDocument.from_json(json.loads(doc.dumps()))
    assert back.ttl_seconds == 3 and back.ts == states[-1].ts
    entries = {b.name: b for b in back.backends}
    assert entries["vllm-0"].address == states[-1].backends["vllm-0"].address != "vllm-0"
    assert entries["vllm-0"].weight_percent == states[-1].backends["vllm-0"].weight_percent


def test_unknown_backends_of_a_replay_get_the_default_score() -> None:
    t = SCENARIOS["kv_cache_saturation"].build()
    loop = AgentLoop(Config(), [])  # a recording names backends nobody configured
    for s in t.snapshots:
        state = loop.observe(s)
    entry = state.backends["vllm-0"]
    assert entry.score == pytest.approx(100 * (1 - entry.penalty), abs=1e-3)
    assert entry.state is BackendState.DEGRADED
    assert loop.balancer.counters["unknown_backend_feedback_total"] == 0  # never fed to the balancer


def test_analyze_gives_the_same_report_through_a_loop_or_a_bare_analyzer() -> None:
    t = SCENARIOS["client_timeout_storm"].build()
    bare = analyze(iter(t.snapshots), Analyzer(backends=t.backends()))
    looped = analyze(iter(t.snapshots), AgentLoop(Config(), t.backends()))
    assert bare.to_json() == looped.to_json()
    assert looped.exit_code() == bare.exit_code() != 0


@pytest.mark.parametrize("doc", [{}, {"schema": "llmdiag.penalties/v1"}, [], {"schema": STATE_SCHEMA}])
def test_from_json_rejects_other_documents(doc: object) -> None:
    with pytest.raises(ValueError, match="llmdiag.state/v1"):
        AgentState.from_json(doc)  # type: ignore[arg-type]


def test_agent_backend_json_keeps_deadlines() -> None:
    b = AgentBackend("vllm-0", "10.0.0.7:8000", 12.5, 0.3, 13, BackendState.COOLING, (), cooling_until=17.25)
    assert AgentBackend.from_json(json.loads(json.dumps(b.to_json()))) == b


def test_wiring_connects_the_tcp_collector_to_timewait_explicitly(monkeypatch: pytest.MonkeyPatch) -> None:
    from llmdiag.agent import wiring
    from llmdiag.collectors.timewait import TimewaitCollector
    from llmdiag.model import CollectorState, CollectorStatus

    class Tcp:  # the tcp collector's contract as timewait uses it (the real one needs BPF: tests/root)
        name = "tcp"

        def active_closes_by_destination(self) -> dict[str, int]:
            return {"127.0.0.1:8000": 7}

        def collect(self, now: float) -> list:
            return []

        def status(self) -> CollectorStatus:
            return CollectorStatus(CollectorState.OK)

        def close(self) -> None:
            pass

    monkeypatch.setitem(wiring.COLLECTOR_FACTORIES, "tcp", lambda config, backends: Tcp())
    running, unavailable = wiring.build_collectors(Config(), [], ["timewait", "tcp"])
    assert not unavailable
    timewait = next(c.inner for c in running if c.name == "timewait")
    assert isinstance(timewait, TimewaitCollector)
    assert timewait.entry_source is not None and timewait.entry_source() == {"127.0.0.1:8000": 7}
    alone, _ = wiring.build_collectors(Config(), [], ["timewait"])
    assert alone[0].inner.entry_source is None  # no tcp collector: entry rates from the kernel timers
    for c in running + alone:
        c.close()


def test_concurrent_collection_gives_the_sequential_snapshot() -> None:
    import concurrent.futures

    from llmdiag.agent.ticker import collect_concurrently, collector_groups
    from llmdiag.collectors.base import GuardedCollector, collect_snapshot
    from llmdiag.model import CollectorState, CollectorStatus, Sample, Scope

    class Fixed:
        def __init__(self, name: str, value: float, fail: bool = False) -> None:
            self.name, self.value, self.fail = name, value, fail

        def collect(self, now: float) -> list[Sample]:
            if self.fail:
                raise RuntimeError("broken")
            # Two collectors write the same host signal: the later one in the list must win, as in sequence.
            return [Sample(Scope.HOST, "", "shared", self.value), Sample(Scope.HOST, "", f"only_{self.name}", now)]

        def status(self) -> CollectorStatus:
            return CollectorStatus(CollectorState.OK)

        def close(self) -> None:
            pass

    names = ["timewait", "engine", "tcp", "proc", "broken"]
    made = [GuardedCollector(Fixed(n, float(i), fail=n == "broken")) for i, n in enumerate(names)]
    groups = collector_groups(made)
    assert [[c.name for c in g] for g in groups if len(g) > 1] == [["tcp", "timewait"]]  # timewait reads tcp
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        snap, seconds = collect_concurrently(made, 5.0, "h", pool)
    again = [GuardedCollector(Fixed(n, float(i), fail=n == "broken")) for i, n in enumerate(names)]
    sequential = collect_snapshot(again, 5.0, "h")
    assert snap.to_json() == sequential.to_json()
    assert snap.host["shared"] == 4.0 - 1.0  # "proc", the last one that did not fail
    assert set(seconds) == set(names)


def test_kernel_read_collectors_run_in_the_ticking_thread_and_the_others_in_the_pool() -> None:
    import concurrent.futures
    import threading

    from llmdiag.agent.ticker import collect_concurrently
    from llmdiag.collectors.base import GuardedCollector
    from llmdiag.model import CollectorState, CollectorStatus, Sample, Scope

    ran_in: dict[str, str] = {}

    class Where:
        def __init__(self, name: str) -> None:
            self.name = name

        def collect(self, now: float) -> list[Sample]:
            ran_in[self.name] = threading.current_thread().name
            return [Sample(Scope.HOST, "", f"only_{self.name}", now)]

        def status(self) -> CollectorStatus:
            return CollectorStatus(CollectorState.OK)

        def close(self) -> None:
            pass

    names = ["engine", "proc", "tcp", "timewait", "gpu", "cuda"]
    with concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="pool") as pool:
        snap, _ = collect_concurrently([GuardedCollector(Where(n)) for n in names], 1.0, "h", pool)
    here = threading.current_thread().name
    assert {n for n, t in ran_in.items() if t == here} == {"proc", "tcp", "timewait", "cuda"}
    assert ran_in["engine"].startswith("pool") and ran_in["gpu"].startswith("pool")
    assert set(snap.host) == {f"only_{n}" for n in names}


def _labelled_backends() -> list:
    from llmdiag.model import Backend

    pod = {"pod": "vllm-0-abc", "namespace": "llm", "container": "vllm", "node": "gpu-7"}
    return [Backend.from_url("http://10.0.0.7:8000", name="vllm-0", engine="vllm", labels=pod),
            Backend.from_url("http://10.0.0.8:8000", name="vllm-1", engine="vllm")]


def test_state_carries_the_balancers_deadlines_in_epoch_seconds_and_the_labels() -> None:
    from balancer_support import ScriptedRandom, VirtualClock

    from llmdiag.model import Snapshot
    from llmdiag.router_feedback.balancer import Balancer

    clock = VirtualClock(1000.0)  # a monotonic-like clock, far from the snapshots' epoch time
    rng = ScriptedRandom([0.5])
    balancer = Balancer(_labelled_backends(), clock=clock, rng=rng)
    loop = AgentLoop(Config(), _labelled_backends(), balancer=balancer)
    ts = 1_733_140_000.0
    state = loop.observe(Snapshot(ts=ts, hostname="gpu-node-7", backends={"vllm-0": {"up": 1}, "vllm-1": {"up": 1}}))
    assert all(b.cooling_until is None and b.ejected_until is None for b in state.backends.values())
    balancer.on_finish("vllm-0", 429, b"KV cache exhausted")  # cools for 3 + 2 * 0.5 = 4 s
    for _ in range(3):
        balancer.on_finish("vllm-1", "connect_error")  # ejected for 15 s
    clock.advance(1.0)
    state = loop.observe(Snapshot(ts=ts + 1.0, hostname="gpu-node-7", backends={"vllm-0": {"up": 1}, "vllm-1": {"up": 0}}))
    cooling, ejected = state.backends["vllm-0"], state.backends["vllm-1"]
    assert cooling.state is BackendState.COOLING and ejected.state is BackendState.EJECTED
    assert cooling.cooling_until == pytest.approx(ts + 4.0) and cooling.ejected_until is None
    assert ejected.ejected_until == pytest.approx(ts + 15.0) and ejected.cooling_until is None
    assert cooling.labels == {"pod": "vllm-0-abc", "namespace": "llm", "container": "vllm", "node": "gpu-7"}
    assert ejected.labels == {}
    doc = json.loads(json.dumps(state.to_json()))
    assert doc["backends"]["vllm-0"]["cooling_until"] == pytest.approx(ts + 4.0)
    assert doc["backends"]["vllm-0"]["labels"]["pod"] == "vllm-0-abc" and "labels" not in doc["backends"]["vllm-1"]
    assert AgentState.from_json(doc) == state
    penalties = state.penalties().to_json()
    assert [b.get("labels") for b in penalties["backends"]] == [cooling.labels, None]
    assert PenaltiesDocument.from_json(penalties) == state.penalties()


def test_the_loops_own_balancer_runs_on_snapshot_time() -> None:
    from llmdiag.model import Snapshot

    loop = AgentLoop(Config(), _labelled_backends())
    ts = 1_733_140_000.0
    loop.observe(Snapshot(ts=ts, backends={"vllm-0": {"up": 1}}))
    for _ in range(3):
        loop.balancer.on_finish("vllm-0", 500, b"boom")
    state = loop.observe(Snapshot(ts=ts + 2.0, backends={"vllm-0": {"up": 1}}))
    assert state.backends["vllm-0"].ejected_until == pytest.approx(ts + 15.0)
    state = loop.observe(Snapshot(ts=ts + 15.0, backends={"vllm-0": {"up": 1}}))
    assert state.backends["vllm-0"].state is BackendState.HALF_OPEN and state.backends["vllm-0"].ejected_until is None


def test_agent_backend_json_keeps_both_deadlines_and_labels() -> None:
    b = AgentBackend("vllm-0", "10.0.0.7:8000", 0.0, 1.0, 0, BackendState.EJECTED, (), cooling_until=1733140004.5,
                     ejected_until=1733140015.0, labels={"pod": "p", "node": "n"})
    assert AgentBackend.from_json(json.loads(json.dumps(b.to_json()))) == b


def test_penalties_builder_labels_both_kinds_of_entry() -> None:
    from llmdiag.analyzers import BackendHealth
    from llmdiag.exporters.penalties import penalties_document
    from llmdiag.model import BackendPenalty

    routed = BackendPenalty("vllm-0", "10.0.0.7:8000", 90.0, 0.1, 90, BackendState.HEALTHY)
    health = {"vllm-0": BackendHealth(0.1, BackendState.HEALTHY), "vllm-9": BackendHealth(0.5, BackendState.DEGRADED)}
    labels = {"vllm-0": {"pod": "a", "node": "gpu-7"}, "vllm-9": {"pod": "b", "node": "gpu-7"}}
    plain = penalties_document(1.0, "n", health, balancer_states=[routed]).to_json()
    assert all("labels" not in b for b in plain["backends"])
    doc = penalties_document(1.0, "n", health, balancer_states=[routed], labels=labels).to_json()
    assert [b["labels"] for b in doc["backends"]] == [{"node": "gpu-7", "pod": "a"}, {"node": "gpu-7", "pod": "b"}]
    strip = [{k: v for k, v in b.items() if k != "labels"} for b in doc["backends"]]
    assert strip == plain["backends"]  # labels add a key and change nothing else

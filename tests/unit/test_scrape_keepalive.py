"""The engine collector's own scrapes: one kept-alive connection per backend, registered as llmdiag's own."""

from __future__ import annotations

from engine_http import SHARED_ENGINES, ScriptedServer

from llmdiag.collectors.engine import EngineCollector
from llmdiag.collectors.http_fetch import KeepAlivePool, http_get
from llmdiag.collectors.own_sockets import OWN_PORTS, OwnPorts
from llmdiag.model import Backend

SYNTH_TEXT = (SHARED_ENGINES / "vllm_SYNTHETIC_current_v1_names_text0.0.4.prom").read_text()


def test_scrapes_reuse_one_connection_per_backend() -> None:
    with ScriptedServer({"/metrics": [SYNTH_TEXT]}, keep_alive=True) as server:
        collector = EngineCollector([Backend.from_url(server.url, name="b0")])
        ups = [s.value for i in range(5) for s in collector.collect(float(i)) if s.name == "up"]
        collector.close()
    assert ups == [1] * 5
    assert len(server.peers) == 5 and len(set(server.peers)) == 1  # five scrapes, one connection
    assert "Connection" not in server.requests[0][1] or server.requests[0][1]["Connection"] != "close"


def test_a_connection_the_server_dropped_is_retried_once_on_a_new_one() -> None:
    pool = KeepAlivePool(OwnPorts())
    with ScriptedServer({"/metrics": [SYNTH_TEXT]}, keep_alive=True, drop_idle=True) as server:
        results = [pool(f"{server.url}/metrics", 1.0, 1 << 22) for _ in range(3)]
        pool.close()
    assert [r.status for r in results] == [200, 200, 200] and all(r.error is None for r in results)
    assert len(set(server.peers)) == 3 and pool.opened_total == 3


def test_own_ports_are_registered_before_connecting_and_linger_after_close() -> None:
    now = [0.0]
    registry = OwnPorts(clock=lambda: now[0], linger_seconds=120)
    seen: list[tuple[int, bool]] = []
    registry.subscribe(lambda port, added: seen.append((port, added)))
    pool = KeepAlivePool(registry)
    with ScriptedServer({"/metrics": [SYNTH_TEXT]}, keep_alive=True) as server:
        assert pool(f"{server.url}/metrics", 1.0, 1 << 22).status == 200
        (port,) = set(server.peers)
        pair = (port, server.port)
        assert seen == [(pair, True)] and registry.pairs() == {pair}
        pool.close()
    now[0] = 119.0
    assert registry.pairs() == {pair}  # its TIME_WAIT socket may still be there
    now[0] = 121.0
    assert registry.pairs() == frozenset() and seen[-1] == (pair, False)


def test_one_shot_get_closes_and_registers_its_port_as_ours() -> None:
    with ScriptedServer({"/metrics": [SYNTH_TEXT]}, keep_alive=True) as server:
        result = http_get(f"{server.url}/metrics", 1.0, 1 << 22)
    assert result.status == 200 and server.requests[0][1]["Connection"] == "close"
    assert (server.peers[0], server.port) in OWN_PORTS.pairs()  # closed, and lingering for its TIME_WAIT


def test_the_registry_stays_bounded_without_a_reader() -> None:
    now = [0.0]
    registry = OwnPorts(clock=lambda: now[0], linger_seconds=120)
    for port in range(2000):  # one-shot GETs (discovery) in a process where nothing calls pairs()
        registry.add(port, 8000)
        registry.release(port, 8000)
        now[0] += 0.1
    assert len(registry.pairs()) <= 1200  # only the last 120 s of them

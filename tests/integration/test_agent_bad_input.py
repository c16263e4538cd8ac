"""Bad input and faults around a running ``llmdiag agent``: it keeps ticking and answering,
says what is wrong in ``/v1/state`` and ``/metrics``, and never crashes.

Covered: garbage, over-long lines, slow clients and a connection flood on the agent-check
port; engines serving a 50 MB ``/metrics``, a never-ending one, or hanging mid-response;
a collector that raises every tick; BPF unavailable (not root); a missing or wrong token.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import socketserver
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent_support import AgentProcess, agent_check, fake_engines, http, metric_value, wait_for

from llmdiag.agent import wiring
from llmdiag.agent.daemon import Agent
from llmdiag.config import Config
from llmdiag.model import CollectorState, CollectorStatus

pytestmark = pytest.mark.integration

FAST = """
[agent]
interval_seconds = 0.5
discover = false
collectors = ["engine", "proc"]
agent_check_timeout_seconds = 1.0
agent_check_max_connections = 16
agent_check_max_line_bytes = 128
"""


class _BadEngine(socketserver.ThreadingTCPServer):
    """An HTTP server on 127.0.0.1 whose /metrics misbehaves in one of three ways."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.stopping = threading.Event()
        super().__init__(("127.0.0.1", 0), _BadHandler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _BadHandler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        server: _BadEngine = self.server  # type: ignore[assignment]
        try:
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                pass
            w = self.wfile
            if server.mode == "huge":  # 50 MB of valid-looking metrics
                line = b"vllm:num_requests_waiting{engine=\"0\"} 1\n"
                count = 50 * 1024 * 1024 // len(line)
                w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n" % (count * len(line)))
                for _ in range(count // 1000):
                    w.write(line * 1000)
            elif server.mode == "endless":  # chunked, never ends
                w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n")
                chunk = b"# HELP x y\n" * 100
                while not server.stopping.is_set():
                    w.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    w.flush()
            elif server.mode == "hang":  # headers and half a body, then nothing
                w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 1000\r\n\r\nvllm:num_requests_")
                w.flush()
                server.stopping.wait(60)
        except OSError:
            pass  # the agent gave up on us: that is the point


@pytest.fixture
def bad_engines() -> Iterator[dict[str, _BadEngine]]:
    servers = {mode: _BadEngine(mode) for mode in ("huge", "endless", "hang")}
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in servers.values()]
    for t in threads:
        t.start()
    yield servers
    for s in servers.values():
        s.stopping.set()
        s.shutdown()
        s.server_close()


def test_bad_engines_and_bad_clients_never_stop_the_agent(tmp_path: Path, bad_engines: dict[str, _BadEngine]) -> None:
    token = "t0ken-for-bad-input"
    with fake_engines([[]]) as (good,):
        urls = [good, *(s.url for s in bad_engines.values())]
        args = [a for url in urls for a in ("--backend", url)]
        agent = AgentProcess(args, tmp_path, config=FAST, token=None, extra_env={"LLMDIAG_AGENT_TOKEN": token})
        agent.token = token
        try:
            agent.wait_ready(ticks=4, timeout=60)
            port = agent.check_port
            assert port is not None
            good_name = good.removeprefix("http://")

            # --- the token: required everywhere but /healthz -------------------------------
            for path in ("/metrics", "/v1/state", "/v1/penalties"):
                assert http(agent.url + path)[0] == 401
                assert http(agent.url + path, token="wrong")[0] == 401
                assert http(agent.url + path, token=token)[0] == 200
            assert http(agent.url + "/healthz")[0] == 200
            # >= : other jobs on this host that discover engines also knock on every local port.
            assert metric_value(agent.metrics(), "llmdiag_http_unauthorized_total") >= 6

            # --- the bad engines: down with a reason, the good one up, ticks go on ------------
            def engines_judged() -> dict | None:
                state = agent.state()
                signals = state["snapshot"]["backends"]
                ups = {name: signals.get(name, {}).get("up") for name in (u.removeprefix("http://") for u in urls)}
                return state if ups[good_name] == 1 and all(v == 0 for n, v in ups.items() if n != good_name) else None

            state = wait_for("the engine collector to judge every engine", engines_judged, 30, 0.5)
            engine = state["collectors"]["engine"]
            assert engine["status"] == "degraded" and engine["reason"], engine
            ticks = state["ticks"]
            metrics = agent.metrics()
            assert metric_value(metrics, "llmdiag_backend_up", backend=good_name) == 1
            for server in bad_engines.values():
                assert metric_value(metrics, "llmdiag_backend_up", backend=server.url.removeprefix("http://")) == 0
            assert metric_value(metrics, "llmdiag_collector_status", collector="engine", status="degraded") == 1

            # --- the agent-check port ---------------------------------------------------------
            assert agent_check(port, f"llm/{good_name}\n".encode()).startswith("ready up ")
            assert agent_check(port, good_name.encode() + b"\n").startswith("ready up ")
            assert agent_check(port, b"llm/no-such-server\n") == "ready up 100%\n"  # unknown: fail open
            assert agent_check(port, b"\xff\xfe\x00garbage\x01\n") == "ready up 100%\n"
            assert agent_check(port, b"x" * 100_000 + b"\n") == "ready up 100%\n"  # over-long line
            started = time.monotonic()
            with socket.create_connection(("127.0.0.1", port), timeout=10) as slow:  # sends nothing
                slow.sendall(b"llm/vll")
                reply = slow.recv(100).decode()
            assert reply == "ready up 100%\n" and time.monotonic() - started < 5  # answered at the read timeout

            # A flood: far more connections than the cap, all held open and silent.
            flood = []
            for _ in range(200):
                try:
                    flood.append(socket.create_connection(("127.0.0.1", port), timeout=5))
                except OSError:
                    break
            try:
                time.sleep(0.3)
                # Over the cap: closed at once; the listener is not wedged.
                assert agent.state()["ticks"] > ticks
            finally:
                for s in flood:
                    s.close()
            wait_for("the agent-check port to answer after the flood",
                     lambda: agent_check(port, f"llm/{good_name}\n".encode()).startswith("ready up "), 10, 0.2)
            metrics = agent.metrics()
            for result in ("ok", "unknown", "bad_request", "too_long", "timeout", "rejected"):
                assert (metric_value(metrics, "llmdiag_agent_check_requests_total", result=result) or 0) >= 1, result
            assert http(agent.url + "/healthz")[0] == 200
        finally:
            code, log, took = agent.stop()
        assert code == 0 and took < 5, log
        assert "Traceback" not in log, log


def test_a_collector_that_raises_every_tick(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process (a collector cannot be broken from outside): the others go on, the state says so."""

    class Broken:
        name = "broken"

        def collect(self, now: float) -> list:
            raise RuntimeError("sensor on fire")

        def status(self) -> CollectorStatus:
            return CollectorStatus(CollectorState.OK)

        def close(self) -> None:
            pass

    monkeypatch.setitem(wiring.COLLECTOR_FACTORIES, "broken", lambda config, backends: Broken())
    config = Config.from_toml('[agent]\ninterval_seconds = 0.1\nlisten_port = 0\ndiscover = false\n'
                              'collectors = ["broken", "proc"]\nprobes = false\n')
    agent = Agent(config)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(asyncio.run(agent.run())), daemon=True)
    thread.start()
    try:
        wait_for("ten ticks", lambda: agent.state.ticks >= 10, 30)
        status = agent.state.collectors["broken"]
        assert status.status is CollectorState.DEGRADED and "sensor on fire" in (status.reason or "")
        assert status.errors_total >= 10
        assert agent.state.collectors["proc"].status is CollectorState.OK
        assert "psi_cpu_some_avg10" in agent.state.snapshot.host or agent.state.snapshot.host  # proc still collects
        port = agent.http_address[1]  # type: ignore[index]
        status_code, body = http(f"http://127.0.0.1:{port}/metrics")
        assert status_code == 200
        assert metric_value(body.decode(), "llmdiag_collector_errors_total", collector="broken") >= 10
        assert metric_value(body.decode(), "llmdiag_collector_up", collector="broken") == 0
        assert agent.health()[0]
    finally:
        agent.stop()
        thread.join(10)
    assert result == [0]
    assert agent.collectors_closed.is_set()


@pytest.mark.root
def test_bpf_unavailable_when_not_root(tmp_path: Path) -> None:
    """The agent run as ``nobody``: the BPF collectors say why they cannot run; the rest serves."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.fail("setpriv (util-linux) is needed to drop root")
    # pytest's tmp_path sits in a root-only directory: nobody needs one it can read.
    tmp = Path(tempfile.mkdtemp(prefix="llmdiag-nobody-"))
    os.chmod(tmp, 0o755)
    with fake_engines([[]]) as (good,), contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, tmp, True)
        agent = AgentProcess(["--backend", good], tmp,
                             config='[agent]\ninterval_seconds = 0.5\ndiscover = false\ncollectors = ["engine", "tcp", "http2"]\n',
                             prefix=[setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", "--"],
                             extra_env={"HOME": str(tmp)})
        try:
            agent.wait_ready(ticks=2, timeout=60)
            state = agent.state()
            for name in ("tcp", "http2"):
                assert state["collectors"][name]["status"] == "unavailable", state["collectors"]
                assert state["collectors"][name]["reason"], state["collectors"]
            assert state["collectors"]["engine"]["status"] == "ok"
            metrics = agent.metrics()
            assert metric_value(metrics, "llmdiag_collector_status", collector="tcp", status="unavailable") == 1
            assert metric_value(metrics, "llmdiag_collector_up", collector="tcp") == 0
        finally:
            code, log, took = agent.stop()
        assert code == 0 and took < 5, log


def test_a_stuck_tick_loop_is_reported_by_healthz(monkeypatch: pytest.MonkeyPatch) -> None:
    """A collector that blocks: /healthz turns 503 with the reason, /v1/state still answers."""
    release = threading.Event()

    class Stuck:
        name = "stuck"

        def collect(self, now: float) -> list:
            release.wait(20)  # a read that never returns (until the test lets it go)
            return []

        def status(self) -> CollectorStatus:
            return CollectorStatus(CollectorState.OK)

        def close(self) -> None:
            release.set()

    monkeypatch.setitem(wiring.COLLECTOR_FACTORIES, "stuck", lambda config, backends: Stuck())
    config = Config.from_toml('[agent]\ninterval_seconds = 0.1\nhealthz_stale_seconds = 0.5\nlisten_port = 0\n'
                              'discover = false\ncollectors = ["stuck"]\nprobes = false\n')
    agent = Agent(config)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(asyncio.run(agent.run())), daemon=True)
    thread.start()
    try:
        wait_for("the HTTP server", lambda: agent.http_address, 10)
        url = f"http://127.0.0.1:{agent.http_address[1]}"  # type: ignore[index]
        status, body = wait_for("/healthz to say the tick loop is stuck",
                                lambda: (r := http(url + "/healthz"))[0] == 503 and r, 10, 0.1)
        assert b"tick loop stuck" in body, body
        assert http(url + "/v1/state")[0] == 200  # the HTTP side never waits on the tick thread
        release.set()
        wait_for("/healthz to recover", lambda: http(url + "/healthz")[0] == 200, 10, 0.1)
    finally:
        release.set()
        agent.stop()
        thread.join(10)
    assert result == [0]

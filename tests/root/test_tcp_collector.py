"""The tcp collector on real loopback traffic (BPF, root): bytes, send-buffer
pressure, peer closes, resets, connections opened before the agent."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest

from llmdiag.bpf.loader import BPFUnavailable
from llmdiag.collectors.tcp import TcpCollector
from llmdiag.config.tcp import TcpConfig
from llmdiag.model import Backend, CollectorState, Scope, Snapshot

pytestmark = pytest.mark.root


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1024)
    srv.settimeout(20)
    yield srv
    srv.close()


def _collector(srv: socket.socket, **config: object) -> tuple[TcpCollector, Backend]:
    backend = Backend.from_url(f"http://127.0.0.1:{srv.getsockname()[1]}", name="b0")
    collector = TcpCollector(TcpConfig(**config), [backend])  # type: ignore[arg-type]
    assert collector.unavailable is None, collector.unavailable
    return collector, backend


def _snapshot(collector: TcpCollector) -> Snapshot:
    snap = Snapshot(ts=time.time())
    snap.extend(collector.collect(snap.ts))
    return snap


def _settle(collector: TcpCollector, predicate, timeout: float = 10.0) -> Snapshot:
    """Collect until ``predicate(snapshot)`` (softirq work on loopback can lag the syscalls a little)."""
    deadline = time.monotonic() + timeout
    while True:
        snap = _snapshot(collector)
        if predicate(snap) or time.monotonic() > deadline:
            return snap
        time.sleep(0.05)


def _pair(srv: socket.socket) -> tuple[socket.socket, socket.socket]:
    client = socket.create_connection(srv.getsockname()[:2], timeout=20)
    server_side, _ = srv.accept()
    server_side.settimeout(20)
    return client, server_side


def _recv_exactly(sock: socket.socket, count: int) -> None:
    while count:
        chunk = sock.recv(min(count, 1 << 20))
        assert chunk, "peer closed early"
        count -= len(chunk)


def test_bulk_send_bytes_are_exact(listener: socket.socket) -> None:
    collector, _ = _collector(listener)
    try:
        dest = "127.0.0.1:%d" % listener.getsockname()[1]
        client, server_side = _pair(listener)
        sizes = [1, 1000, 65536, 300_000, 7, 2_000_000]
        reader = threading.Thread(target=_recv_exactly, args=(server_side, sum(sizes)))
        reader.start()
        for size in sizes:
            client.sendall(os.urandom(size))
        reader.join(10)
        server_side.sendall(b"r" * 123_457)
        _recv_exactly(client, 123_457)
        snap = _settle(collector, lambda s: s.destinations.get(dest, {}).get("tcp_send_bytes_total") == sum(sizes))
        client.close()
        server_side.close()
    finally:
        collector.close()
    client_side = snap.destinations[dest]
    assert client_side["tcp_send_bytes_total"] == sum(sizes)
    assert client_side["tcp_sends_total"] >= len(sizes)
    assert snap.backends["b0"]["tcp_send_bytes_total"] == 123_457
    assert snap.backends["b0"]["tcp_connections_active"] == 1
    assert client_side["tcp_connections_active"] == 1
    latency = client_side["tcp_connect_latency_seconds"]
    assert latency.count == 1 and 0 < latency.p50 < 1.0
    assert snap.host["bpf_map_full_total"] == {"program=tcp_health": 0}
    assert snap.host["tcp_sock_common_mismatch_total"] == 0


def test_nonblocking_sender_eagain_counts_as_sndbuf_full(listener: socket.socket) -> None:
    collector, _ = _collector(listener, send_timing=False)
    try:
        client, server_side = _pair(listener)
        server_side.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        server_side.setblocking(False)
        eagain = 0
        sent = 0
        for _ in range(2000):  # the client never reads: the send buffer fills up
            try:
                sent += server_side.send(b"x" * 8192)
            except BlockingIOError:
                eagain += 1
                if eagain >= 25:
                    break
        assert eagain == 25
        snap = _settle(collector, lambda s: s.backends["b0"]["tcp_sndbuf_full_total"] >= eagain)
        client.close()
        server_side.close()
    finally:
        collector.close()
    assert snap.backends["b0"]["tcp_sndbuf_full_total"] == eagain
    assert snap.backends["b0"]["tcp_send_bytes_total"] == sent


def test_blocking_sender_time_in_send_is_measured(listener: socket.socket) -> None:
    collector, _ = _collector(listener, send_timing=True, timed_pids=(os.getpid(),), send_block_seconds=0.005)
    try:
        client, server_side = _pair(listener)
        server_side.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        server_side.settimeout(None)  # a truly blocking send(): CPython polls first when a timeout is set
        total = 200_000

        def slow_reader() -> None:
            left = total
            while left:
                chunk = client.recv(16384)
                if not chunk:
                    return
                left -= len(chunk)
                time.sleep(0.005)

        reader = threading.Thread(target=slow_reader)
        reader.start()
        started = time.monotonic()
        server_side.sendall(b"y" * total)  # blocks while the slow reader drains
        blocked_for = time.monotonic() - started
        reader.join(30)
        snap = _settle(collector, lambda s: s.backends["b0"]["tcp_send_bytes_total"] == total)
        client.close()
        server_side.close()
    finally:
        collector.close()
    server = snap.backends["b0"]
    assert server["tcp_send_bytes_total"] == total
    assert blocked_for > 0.2
    # Most of the wall time of sendall() was spent waiting inside send() for buffer space.
    assert 0.5 * blocked_for <= server["tcp_send_blocked_seconds_total"] <= blocked_for + 0.05
    assert server["tcp_sndbuf_full_total"] >= 1


def test_client_closing_mid_response_is_a_peer_close_then_reset(listener: socket.socket) -> None:
    collector, _ = _collector(listener)
    try:
        dest = "127.0.0.1:%d" % listener.getsockname()[1]
        client, server_side = _pair(listener)
        request = b"GET /v1/completions\r\n\r\n"
        client.sendall(request)
        _recv_exactly(server_side, len(request))
        server_side.sendall(b"data: token\n\n" * 10)
        _recv_exactly(client, 130)
        client.close()  # gives up mid-stream: FIN with nothing unread
        snap = _settle(collector, lambda s: s.backends["b0"]["tcp_peer_closes_total"] >= 1)
        assert snap.backends["b0"]["tcp_peer_closes_total"] == 1
        time.sleep(0.05)
        with pytest.raises(OSError):  # the server keeps streaming into a closed socket
            for _ in range(50):
                server_side.send(b"data: token\n\n")
                time.sleep(0.01)
        snap = _settle(collector, lambda s: s.backends["b0"]["tcp_resets_received_total"] >= 1)
        server_side.close()
    finally:
        collector.close()
    assert snap.backends["b0"]["tcp_resets_received_total"] == 1
    assert snap.destinations[dest]["tcp_resets_sent_total"] == 1
    assert snap.backends["b0"]["tcp_connections_active"] == 0


def test_so_linger_zero_close_is_a_reset(listener: socket.socket) -> None:
    collector, _ = _collector(listener)
    try:
        dest = "127.0.0.1:%d" % listener.getsockname()[1]
        for _ in range(3):
            client, server_side = _pair(listener)
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client.close()
            server_side.close()
        snap = _settle(collector, lambda s: s.backends["b0"]["tcp_resets_received_total"] >= 3)
    finally:
        collector.close()
    assert snap.destinations[dest]["tcp_resets_sent_total"] == 3
    assert snap.backends["b0"]["tcp_resets_received_total"] == 3
    assert snap.destinations[dest]["tcp_active_closes_total"] == 0  # a reset makes no TIME_WAIT
    assert snap.destinations[dest]["tcp_connections_active"] == 0


def test_connections_opened_before_start_are_counted_and_attributed(listener: socket.socket) -> None:
    port = listener.getsockname()[1]
    pairs = [_pair(listener) for _ in range(3)]
    collector, _ = _collector(listener)
    try:
        ss = subprocess.run(["ss", "-Htn", "state", "established", f"( sport = :{port} )"],
                            capture_output=True, text=True, check=True)
        established = len(ss.stdout.splitlines())
        for client, server_side in pairs:
            server_side.sendall(b"z" * 10_000)
            _recv_exactly(client, 10_000)
        snap = _settle(collector, lambda s: s.backends["b0"]["tcp_send_bytes_total"] == 30_000)
        assert snap.backends["b0"]["tcp_connections_active"] == established == 3
        assert snap.backends["b0"]["tcp_send_bytes_total"] == 30_000
        assert collector.globals()["lazy_fills"] >= 3  # attributed from struct sock_common
        assert collector.globals()["sock_common_mismatch"] == 0
        for client, server_side in pairs:
            client.close()
            server_side.close()
        snap = _settle(collector, lambda s: s.backends["b0"]["tcp_connections_active"] == 0)
    finally:
        collector.close()
    assert snap.backends["b0"]["tcp_connections_active"] == 0
    assert snap.backends["b0"]["tcp_peer_closes_total"] == 3


def test_denied_bpf_load_is_unavailable_with_reason(listener: socket.socket) -> None:
    def deny(name: str, defines: object) -> object:
        raise BPFUnavailable("bpf(BPF_PROG_LOAD) denied by test", "run as root")

    backend = Backend.from_url(f"http://127.0.0.1:{listener.getsockname()[1]}")
    collector = TcpCollector(TcpConfig(), [backend], program_factory=deny)  # type: ignore[arg-type]
    status = collector.status()
    assert status.status is CollectorState.UNAVAILABLE
    assert "denied by test" in status.reason and "run as root" in status.reason
    assert collector.collect(time.time()) == []
    assert collector.active_closes_by_destination() is None
    collector.close()
    collector.close()


def test_close_detaches_and_stops_feeding_timewait(listener: socket.socket) -> None:
    collector, _ = _collector(listener)
    collector.collect(time.time())
    assert collector.program is not None
    collector.close()
    assert collector.program.closed
    assert collector.program.bpf.num_open_tracepoints() == 0
    assert collector.active_closes_by_destination() is None


def test_wiring_factory_raises_collector_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    from llmdiag.bpf import loader
    from llmdiag.agent.wiring import COLLECTOR_FACTORIES, CollectorUnavailable
    from llmdiag.config import Config

    def deny(cls, name, defines=None, **_kw):  # noqa: ANN001
        raise BPFUnavailable("BPF denied by test", "grant CAP_BPF")

    monkeypatch.setattr(loader.Program, "load", classmethod(deny))
    with pytest.raises(CollectorUnavailable, match="BPF denied by test.*grant CAP_BPF"):
        COLLECTOR_FACTORIES["tcp"](Config(), [Backend.from_url("http://127.0.0.1:8000")])
    timewait = COLLECTOR_FACTORIES["timewait"](Config(), [Backend.from_url("http://127.0.0.1:8000")])
    timewait.collect(time.time())
    assert timewait.entry_rate_source == "timers"


def test_udp_on_the_backend_port_is_not_counted(listener: socket.socket) -> None:
    """The raw send tracepoint has no protocol argument: skc_prot tells TCP from UDP (QUIC on 443...)."""
    collector, _ = _collector(listener)
    port = listener.getsockname()[1]
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp, \
                socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sink:
            udp.bind(("127.0.0.1", port))  # same port number as the TCP backend
            sink.bind(("127.0.0.1", 0))
            for _ in range(20):
                udp.sendto(b"q" * 1000, sink.getsockname())
            client, server_side = _pair(listener)
            server_side.sendall(b"t" * 5000)
            _recv_exactly(client, 5000)
        snap = _settle(collector, lambda s: s.backends["b0"]["tcp_send_bytes_total"] >= 5000)
        client.close()
        server_side.close()
    finally:
        collector.close()
    assert snap.backends["b0"]["tcp_send_bytes_total"] == 5000
    assert snap.host["tcp_sock_common_mismatch_total"] == 0


def test_full_endpoint_map_is_counted_and_degrades_status() -> None:
    listeners = []
    for _ in range(24):
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(4)
        srv.settimeout(10)
        listeners.append(srv)
    ports = tuple(s.getsockname()[1] for s in listeners)
    collector = TcpCollector(TcpConfig(client_ports=ports, max_endpoints=16), [])
    assert collector.unavailable is None, collector.unavailable
    try:
        for srv in listeners:
            client, server_side = _pair(srv)
            client.close()
            server_side.close()
        snap = _settle(collector, lambda s: s.host["bpf_map_full_total"]["program=tcp_health"] > 0)
        status = collector.status()
    finally:
        collector.close()
        for srv in listeners:
            srv.close()
    assert snap.host["bpf_map_full_total"]["program=tcp_health"] > 0
    assert len(snap.destinations) == 16  # the map holds 16 endpoints; the rest were counted as failures
    assert status.status is CollectorState.DEGRADED and "map full" in status.reason


def test_ipv6_bytes_and_a_connection_opened_before_start() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 in this Python")
    srv = socket.socket(socket.AF_INET6)
    try:
        srv.bind(("::1", 0))
    except OSError as exc:
        pytest.skip(f"no ::1 here: {exc}")
    srv.listen(8)
    srv.settimeout(10)
    port = srv.getsockname()[1]
    old_client, old_server = _pair(srv)
    collector = TcpCollector(TcpConfig(), [Backend.from_url(f"http://[::1]:{port}", name="v6")])
    assert collector.unavailable is None, collector.unavailable
    dest = f"[::1]:{port}"
    try:
        old_server.sendall(b"o" * 4321)  # attributed from struct sock_common (skc_v6_daddr)
        _recv_exactly(old_client, 4321)
        old_client.sendall(b"p" * 1234)
        _recv_exactly(old_server, 1234)
        new_client, new_server = _pair(srv)
        new_client.sendall(b"n" * 100_000)
        _recv_exactly(new_server, 100_000)
        snap = _settle(collector, lambda s: s.destinations.get(dest, {}).get("tcp_send_bytes_total") == 101_234)
        for sock in (old_client, old_server, new_client, new_server):
            sock.close()
    finally:
        collector.close()
        srv.close()
    assert snap.backends["v6"]["tcp_send_bytes_total"] == 4321
    assert snap.destinations[dest]["tcp_send_bytes_total"] == 101_234
    assert snap.backends["v6"]["tcp_connections_active"] == 2
    assert snap.destinations[dest]["tcp_connect_latency_seconds"].count == 1
    assert snap.host["tcp_sock_common_mismatch_total"] == 0


def test_llmdiags_own_scrapes_are_not_counted_but_a_clients_requests_are() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
    from engine_http import ScriptedServer

    from llmdiag.collectors.engine import EngineCollector

    body = "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine=\"0\"} 1.0\n"
    with ScriptedServer({"/metrics": [body]}, keep_alive=True) as server:
        backend = Backend.from_url(server.url, name="b0")
        tcp = TcpCollector(TcpConfig(), [backend])
        assert tcp.unavailable is None, tcp.unavailable
        engine = EngineCollector([backend])
        try:
            for i in range(5):
                engine.collect(float(i))
            engine.close()  # closes the kept-alive connection: the active close is llmdiag's own
            snap = _settle(tcp, lambda s: False, timeout=0.3)
            ours = snap.backends["b0"]
            assert ours["tcp_sends_total"] == 0 and ours["tcp_send_bytes_total"] == 0
            assert ours["tcp_connections_active"] == 0 and ours["tcp_peer_closes_total"] == 0
            # A client of the engine doing the same is counted.
            client = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            client.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = b""
            while not answer.endswith(b"1.0\n"):
                answer += client.recv(1 << 16)
            client.close()
            snap = _settle(tcp, lambda s: s.backends["b0"]["tcp_peer_closes_total"] >= 1)
            theirs = snap.backends["b0"]
            assert theirs["tcp_sends_total"] >= 1 and theirs["tcp_send_bytes_total"] >= len(body)
            assert theirs["tcp_peer_closes_total"] == 1
        finally:
            tcp.close()


def test_connect_hist_is_read_again_only_after_new_connects(listener: socket.socket) -> None:
    """The latency map is re-read while connects complete and for one tick after; idle ticks reuse
    the last reading, and a new connect is in the next snapshots' latency all the same."""
    collector, _ = _collector(listener)
    dest = "127.0.0.1:%d" % listener.getsockname()[1]
    try:
        pairs = [_pair(listener)]
        first = _settle(collector, lambda s: s.destinations.get(dest, {}).get("tcp_connect_latency_seconds") is not None
                        and s.destinations[dest]["tcp_connect_latency_seconds"].count == 1)
        assert first.destinations[dest]["tcp_connect_latency_seconds"].count == 1
        for _ in range(3):
            _snapshot(collector)  # the connect total settles: two equal reads
        reads = collector.hist_reads_total
        idle = [_snapshot(collector) for _ in range(3)]
        assert collector.hist_reads_total == reads  # nothing connected: not read
        assert all(s.destinations[dest]["tcp_connect_latency_seconds"].count == 1 for s in idle)
        pairs.append(_pair(listener))
        later = _settle(collector, lambda s: s.destinations[dest]["tcp_connect_latency_seconds"].count == 2)
        assert later.destinations[dest]["tcp_connect_latency_seconds"].count == 2
        assert collector.hist_reads_total > reads
        for client, server_side in pairs:
            client.close()
            server_side.close()
    finally:
        collector.close()


def test_an_idle_endpoints_samples_are_reused_and_a_change_is_read(listener: socket.socket) -> None:
    collector, _ = _collector(listener)
    try:
        client, server_side = _pair(listener)
        _settle(collector, lambda s: s.backends.get("b0", {}).get("tcp_connections_active") == 1)
        first = {(s.scope, s.subject, s.name): s for s in collector.collect(time.time()) if s.subject == "b0"}
        second = {(s.scope, s.subject, s.name): s for s in collector.collect(time.time()) if s.subject == "b0"}
        assert first.keys() == second.keys() and all(second[k] is first[k] for k in first)  # idle: the same objects
        server_side.sendall(b"x" * 1000)
        _recv_exactly(client, 1000)
        later = _settle(collector, lambda s: s.backends["b0"]["tcp_send_bytes_total"] >= 1000)
        assert later.backends["b0"]["tcp_send_bytes_total"] == first[(Scope.BACKEND, "b0", "tcp_send_bytes_total")].value + 1000
        client.close()
        server_side.close()
    finally:
        collector.close()


def _listen_on(host: str, port: int) -> socket.socket:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((host, port))
    srv.listen(16)
    srv.settimeout(20)
    return srv


@pytest.mark.parametrize("with_node", [True, False])
def test_backends_sharing_a_port_are_told_apart_by_the_address_reached(with_node: bool) -> None:
    # Engines in pods all listen on 8000, each in its own network namespace at its pod IP. Here:
    # two "pods" at 127.0.0.2 and 127.0.0.3; maybe an engine of the node's namespace on a loopback
    # URL, whose traffic arrives at 127.0.0.1 and at the node's other addresses (127.0.0.5, 127.0.0.4):
    # the port's traffic at addresses no pod has is its, else nobody's. One connection to pod-a is
    # opened before the collector starts.
    first = _listen_on("127.0.0.2", 0)
    port = first.getsockname()[1]
    listeners = {"127.0.0.2": first}
    try:
        for host in ("127.0.0.3", "127.0.0.1", "127.0.0.5", "127.0.0.4"):
            listeners[host] = _listen_on(host, port)
    except OSError as exc:
        for srv in listeners.values():
            srv.close()
        pytest.skip(f"cannot listen on the same port at several loopback addresses: {exc}")
    backends = [Backend.from_url(f"http://127.0.0.2:{port}", name="pod-a"),
                Backend.from_url(f"http://127.0.0.3:{port}", name="pod-b")]
    if with_node:
        backends.append(Backend.from_url(f"http://127.0.0.1:{port}", name="node"))
    before = _pair(listeners["127.0.0.2"])
    collector = TcpCollector(TcpConfig(), backends)
    assert collector.unavailable is None, collector.unavailable
    sizes = {"127.0.0.2": 10_000, "127.0.0.3": 20_000, "127.0.0.1": 30_000, "127.0.0.5": 5_000, "127.0.0.4": 7_000}
    pairs = [before]
    rest = "node" if with_node else None
    try:
        for host, size in sizes.items():
            client, server_side = before if host == "127.0.0.2" else _pair(listeners[host])
            pairs.append((client, server_side))
            server_side.sendall(b"s" * size)
            _recv_exactly(client, size)
        # pod-b's clients give up: two resets, received by pod-b only
        for _ in range(2):
            client, server_side = _pair(listeners["127.0.0.3"])
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client.close()
            server_side.close()
        snap = _settle(collector, lambda s: s.backends["pod-b"]["tcp_resets_received_total"] >= 2
                       and (s.backends if rest else s.destinations)[rest or f"*:{port}"]["tcp_send_bytes_total"] >= 42_000)
    finally:
        collector.close()
        for client, server_side in pairs:
            client.close()
            server_side.close()
        for srv in listeners.values():
            srv.close()
    names = [b.name for b in backends]
    got = {name: snap.backends[name]["tcp_send_bytes_total"] for name in names}
    rest_signals = snap.backends["node"] if with_node else snap.destinations[f"*:{port}"]
    assert got == {"pod-a": 10_000, "pod-b": 20_000, **({"node": 42_000} if with_node else {})}
    assert rest_signals["tcp_send_bytes_total"] == 42_000
    assert rest_signals["tcp_connections_active"] == 3
    assert {n: snap.backends[n]["tcp_resets_received_total"] for n in names} == {
        "pod-a": 0, "pod-b": 2, **({"node": 0} if with_node else {})}
    assert snap.backends["pod-a"]["tcp_connections_active"] == 1  # opened before start: told apart by address too
    assert snap.backends["pod-b"]["tcp_connections_active"] == 1
    assert snap.host["tcp_sock_common_mismatch_total"] == 0


def test_a_pod_engines_connections_opened_before_start_are_counted() -> None:
    # The start count comes from sock_diag, which answers for the agent's namespace only; a pod
    # engine's connections are read through its process. Without that, closing them later drove
    # the pod backend's count below zero (shown as 0) and hid that many live connections for good.
    from pod_support import fake_engine_argv, network_namespace_pod  # noqa: PLC0415

    port = 18141
    with network_namespace_pod([(fake_engine_argv("0.0.0.0", port), port)], {}, tag="t") as pod:
        early = [socket.create_connection((pod.address, port), timeout=20) for _ in range(2)]
        backend = Backend.from_url(f"http://{pod.address}:{port}", name="pod").with_process(pod.engine.pid)
        collector = TcpCollector(TcpConfig(), [backend])
        assert collector.unavailable is None, collector.unavailable
        try:
            snap = _settle(collector, lambda s: s.backends["pod"]["tcp_connections_active"] == 2)
            assert snap.backends["pod"]["tcp_connections_active"] == 2
            late = socket.create_connection((pod.address, port), timeout=20)
            for sock in early:
                sock.close()
            snap = _settle(collector, lambda s: s.backends["pod"]["tcp_connections_active"] == 1)
            assert snap.backends["pod"]["tcp_connections_active"] == 1  # the late one, not 0 (= 1 - 2, clamped)
            late.close()
            snap = _settle(collector, lambda s: s.backends["pod"]["tcp_connections_active"] == 0)
            assert snap.backends["pod"]["tcp_connections_active"] == 0
        finally:
            collector.close()

"""TIME_WAIT per destination on real loopback connections, cross-checked with
``ss`` and with the tcp collector's BPF active-close count."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import pytest

from llmdiag.bpf.loader import BPFUnavailable
from llmdiag.collectors import procnet
from llmdiag.collectors.tcp import TcpCollector
from llmdiag.collectors.timewait import TimewaitCollector
from llmdiag.config.tcp import TcpConfig, TimewaitConfig
from llmdiag.model import Backend, CollectorState, Snapshot

pytestmark = pytest.mark.root

N = 400


class StepClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _short_connections(srv: socket.socket, count: int) -> None:
    """``count`` request/response exchanges where the client closes first (it gets the TIME_WAIT)."""
    for _ in range(count):
        client = socket.create_connection(srv.getsockname(), timeout=10)
        server_side, _ = srv.accept()
        client.sendall(b"ping")
        server_side.recv(4)
        client.close()
        server_side.recv(1)  # wait for the FIN, so the client reaches FIN_WAIT2 first
        server_side.close()


def _ss_timewait(port: int) -> int:
    out = subprocess.run(["ss", "-Htan", "state", "time-wait", f"( dport = :{port} )"],
                         capture_output=True, text=True, check=True).stdout
    return len(out.splitlines())


def _snapshot(*collectors) -> Snapshot:
    snap = Snapshot(ts=time.time())
    for collector in collectors:
        snap.extend(collector.collect(snap.ts))
    return snap


@pytest.fixture
def listener():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1024)
    srv.settimeout(10)
    yield srv
    srv.close()


def _expected_available(dest_tw: int, rate: float, dest: str) -> int:
    """The headroom rule of the collector, restated from the sysctls (see timewait.py)."""
    port_range = procnet.read_port_range()
    usable = port_range.size - sum(1 for p in procnet.read_reserved_ports() if p in port_range)
    reuse = procnet.read_tw_reuse()
    loopback = dest.startswith("127.")
    held = min(dest_tw, int(rate * 1.0 + 0.999)) if (reuse == 1 or (reuse == 2 and loopback)) else dest_tw
    return usable - held


def test_short_connections_fill_timewait_with_bpf_entry_rate(listener: socket.socket) -> None:
    port = listener.getsockname()[1]
    dest = f"127.0.0.1:{port}"
    backend = Backend.from_url(f"http://{dest}", name="b0")
    tcp = TcpCollector(TcpConfig(send_timing=False), [backend])
    assert tcp.unavailable is None, tcp.unavailable
    clock = StepClock()
    # dump_every_ticks=1: the counts are compared with ss right after the connections close
    timewait = TimewaitCollector(TimewaitConfig(rate_window_seconds=30, dump_every_ticks=1), [backend], clock=clock,
                                 entry_source=tcp.active_closes_by_destination)
    try:
        _snapshot(tcp, timewait)  # first reading of the BPF counters: the rate needs two
        _short_connections(listener, N)
        clock.now = 20.0
        deadline = time.monotonic() + 3
        while True:
            snap = _snapshot(tcp, timewait)
            if snap.destinations[dest].get("tcp_active_closes_total") == N or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        ss_count = _ss_timewait(port)
    finally:
        tcp.close()
    signals = snap.destinations[dest]
    assert signals["tcp_active_closes_total"] == N
    assert abs(signals["timewait_sockets"] - ss_count) <= 0.02 * ss_count
    assert signals["timewait_sockets"] >= 0.98 * N
    assert timewait.entry_rate_source == "bpf"
    assert signals["timewait_entry_rate"] == pytest.approx(N / 20.0)
    available = signals["ephemeral_ports_available"]
    assert available == _expected_available(signals["timewait_sockets"], N / 20.0, dest)
    assert signals["port_exhaustion_eta_seconds"] == pytest.approx(available / (N / 20.0))
    assert snap.host["sockstat_tcp_tw"] >= signals["timewait_sockets"]
    assert timewait.status().status is CollectorState.OK


def test_without_bpf_the_rate_comes_from_timewait_timers(listener: socket.socket) -> None:
    port = listener.getsockname()[1]
    dest = f"127.0.0.1:{port}"
    backend = Backend.from_url(f"http://{dest}", name="b0")

    def deny(name: str, defines: object) -> object:
        raise BPFUnavailable("BPF load denied by test", "run as root")

    tcp = TcpCollector(TcpConfig(), [backend], program_factory=deny)  # type: ignore[arg-type]
    assert tcp.status().status is CollectorState.UNAVAILABLE
    timewait = TimewaitCollector(TimewaitConfig(rate_window_seconds=30), [backend],
                                 entry_source=tcp.active_closes_by_destination)
    _short_connections(listener, 100)
    snap = _snapshot(tcp, timewait)
    ss_count = _ss_timewait(port)
    signals = snap.destinations[dest]
    assert timewait.entry_rate_source == "timers"
    assert abs(signals["timewait_sockets"] - ss_count) <= 0.02 * ss_count
    # Every one of them entered TIME_WAIT within the last 30 s.
    assert signals["timewait_entry_rate"] == pytest.approx(signals["timewait_sockets"] / 30.0)
    assert signals["port_exhaustion_eta_seconds"] == pytest.approx(
        signals["ephemeral_ports_available"] / signals["timewait_entry_rate"])
    assert "tcp_active_closes_total" not in signals
    assert timewait.status().status is CollectorState.OK


def test_missing_proc_files_degrade_but_sock_diag_still_counts(listener: socket.socket, tmp_path: Path) -> None:
    port = listener.getsockname()[1]
    dest = f"127.0.0.1:{port}"
    _short_connections(listener, 20)
    timewait = TimewaitCollector(TimewaitConfig(), [Backend.from_url(f"http://{dest}")], proc_root=tmp_path)
    snap = _snapshot(timewait)
    status = timewait.status()
    assert status.status is CollectorState.DEGRADED
    assert "sockstat" in status.reason and "ip_local_port_range" in status.reason
    assert "sockstat_tcp_tw" not in snap.host  # missing, not a made-up zero
    assert snap.destinations[dest]["timewait_sockets"] == 20
    assert "ephemeral_ports_available" not in snap.destinations[dest]

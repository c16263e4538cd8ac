"""/proc parsing for the TIME_WAIT collector, and its headroom arithmetic, on
recorded and malformed files (no root, no kernel)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from llmdiag.collectors import procnet
from llmdiag.collectors.sockdiag import DestinationSockets, SockDiagError, format_endpoint
from llmdiag.collectors.timewait import TimewaitCollector
from llmdiag.config.tcp import TimewaitConfig
from llmdiag.model import Backend, CollectorState, Snapshot


@pytest.fixture
def fixtures(shared_dir: Path) -> Path:
    return shared_dir / "fixtures" / "host"


def test_sockstat_recorded_on_kernel_6_18(fixtures: Path) -> None:
    parsed = procnet.parse_sockstat((fixtures / "host_proc_net_sockstat_kernel6.18.txt").read_text())
    assert parsed["TCP"] == {"inuse": 1, "orphan": 0, "tw": 1948, "alloc": 1, "mem": 79}
    assert parsed["sockets"] == {"used": 13}
    assert parsed["FRAG"] == {"inuse": 0, "memory": 0}


def test_sockstat_node_exporter_fixture(fixtures: Path) -> None:
    parsed = procnet.parse_sockstat((fixtures / "node_exporter_fixture_proc_net_sockstat.txt").read_text())
    assert parsed["TCP"]["tw"] == 4 and parsed["TCP"]["inuse"] == 4


@pytest.mark.parametrize(
    "text",
    ["", "garbage\n", "TCP: inuse\n", "TCP: inuse one tw 2\n", "UDP: inuse 0 mem 0\n", "\0\0\0"],
)
def test_sockstat_without_a_usable_tcp_line_is_an_error(text: str) -> None:
    with pytest.raises(procnet.ProcNetError, match="TCP"):
        procnet.parse_sockstat(text)


def test_sockstat_skips_a_broken_line_but_keeps_tcp() -> None:
    parsed = procnet.parse_sockstat("sockets: used x\nTCP: inuse 3 orphan 0 tw 7 alloc 4 mem 1\nUDP: inuse\n")
    assert parsed == {"TCP": {"inuse": 3, "orphan": 0, "tw": 7, "alloc": 4, "mem": 1}}


def test_port_range() -> None:
    rng = procnet.parse_port_range("32768\t60999\n")
    assert (rng.low, rng.high, rng.size) == (32768, 60999, 28232)
    assert 32768 in rng and 60999 in rng and 61000 not in rng


@pytest.mark.parametrize("text", ["", "32768", "a b", "60999 32768", "0 100", "1 70000", "1 2 3"])
def test_bad_port_range(text: str) -> None:
    with pytest.raises(procnet.ProcNetError):
        procnet.parse_port_range(text)


def test_reserved_ports() -> None:
    assert procnet.parse_reserved_ports("\n") == frozenset()
    assert procnet.parse_reserved_ports("8000,40000-40002\n") == {8000, 40000, 40001, 40002}
    with pytest.raises(procnet.ProcNetError):
        procnet.parse_reserved_ports("9-1")
    with pytest.raises(procnet.ProcNetError):
        procnet.parse_reserved_ports("http")


def _proc_tree(root: Path, sockstat: str | None, port_range: str | None = "32768 60999\n",
               reserved: str = "\n", tw_reuse: str = "2\n") -> Path:
    (root / "net").mkdir(parents=True)
    (root / "sys/net/ipv4").mkdir(parents=True)
    if sockstat is not None:
        (root / "net/sockstat").write_text(sockstat)
    if port_range is not None:
        (root / "sys/net/ipv4/ip_local_port_range").write_text(port_range)
    (root / "sys/net/ipv4/ip_local_reserved_ports").write_text(reserved)
    (root / "sys/net/ipv4/tcp_tw_reuse").write_text(tw_reuse)
    return root


def _diag(per_dest: dict[str, DestinationSockets]):
    def dump(**_kwargs: object) -> dict[str, DestinationSockets]:
        return per_dest
    return dump


def _collect(collector: TimewaitCollector) -> Snapshot:
    snap = Snapshot(ts=1.0)
    snap.extend(collector.collect(1.0))
    return snap


def test_headroom_and_eta_from_timers_without_reuse(tmp_path: Path, fixtures: Path) -> None:
    root = _proc_tree(tmp_path, (fixtures / "host_proc_net_sockstat_kernel6.18.txt").read_text(),
                      port_range="40000 40999\n", reserved="40000-40009\n", tw_reuse="0\n")
    per_dest = {"10.0.0.7:8000": DestinationSockets(timewait=600, timewait_recent=100, other_ephemeral=50)}
    collector = TimewaitCollector(TimewaitConfig(rate_window_seconds=10), [], proc_root=root, diag=_diag(per_dest))
    snap = _collect(collector)
    assert snap.host["sockstat_tcp_tw"] == 1948 and snap.host["sockstat_tcp_inuse"] == 1
    dest = snap.destinations["10.0.0.7:8000"]
    assert dest["timewait_sockets"] == 600
    assert dest["timewait_entry_rate"] == 10.0  # 100 entered within the last 10 s
    # 1000 ports - 10 reserved - 50 open - 600 in TIME_WAIT
    assert dest["ephemeral_ports_available"] == 340
    assert dest["port_exhaustion_eta_seconds"] == 34.0
    assert collector.status().status is CollectorState.OK


def test_tw_reuse_2_frees_loopback_timewait_but_not_remote(tmp_path: Path) -> None:
    root = _proc_tree(tmp_path, "TCP: inuse 1 orphan 0 tw 700 alloc 1 mem 1\n", port_range="40000 40999\n")
    per_dest = {
        "127.0.0.1:8000": DestinationSockets(timewait=600, timewait_recent=100),
        "10.0.0.7:8000": DestinationSockets(timewait=100, timewait_recent=0),
    }
    snap = _collect(TimewaitCollector(TimewaitConfig(rate_window_seconds=10), [], proc_root=root,
                                      diag=_diag(per_dest)))
    loop = snap.destinations["127.0.0.1:8000"]
    # reusable after 1 s: only ~rate * 1 s of them still hold a port
    assert loop["ephemeral_ports_available"] == 1000 - 10
    remote = snap.destinations["10.0.0.7:8000"]
    assert remote["ephemeral_ports_available"] == 900
    assert remote["timewait_entry_rate"] == 0.0
    assert "port_exhaustion_eta_seconds" not in remote  # nothing is running out


def test_backends_always_reported_and_small_destinations_filtered(tmp_path: Path) -> None:
    root = _proc_tree(tmp_path, "TCP: inuse 1 orphan 0 tw 3 alloc 1 mem 1\n")
    per_dest = {"10.0.0.9:443": DestinationSockets(timewait=2), "10.0.0.8:80": DestinationSockets(timewait=50)}
    backend = Backend.from_url("http://10.0.0.7:8000", name="vllm-0")
    snap = _collect(TimewaitCollector(TimewaitConfig(min_sockets=10), [backend], proc_root=root,
                                      diag=_diag(per_dest)))
    assert set(snap.destinations) == {"10.0.0.7:8000", "10.0.0.8:80"}
    assert snap.destinations["10.0.0.7:8000"]["timewait_sockets"] == 0


def test_bpf_entry_rate_uses_counter_deltas(tmp_path: Path) -> None:
    root = _proc_tree(tmp_path, "TCP: inuse 1 orphan 0 tw 3 alloc 1 mem 1\n", tw_reuse="0\n")
    totals = {"10.0.0.7:8000": 1000}
    now = [0.0]
    per_dest = {"10.0.0.7:8000": DestinationSockets(timewait=500, timewait_recent=999)}
    collector = TimewaitCollector(TimewaitConfig(rate_window_seconds=10), [], proc_root=root,
                                  clock=lambda: now[0], diag=_diag(per_dest), entry_source=lambda: totals)
    first = _collect(collector).destinations["10.0.0.7:8000"]
    assert collector.entry_rate_source == "timers"  # one reading is no rate yet
    assert first["timewait_entry_rate"] == 99.9
    now[0] = 4.0
    totals["10.0.0.7:8000"] = 1200
    second = _collect(collector).destinations["10.0.0.7:8000"]
    assert collector.entry_rate_source == "bpf"
    assert second["timewait_entry_rate"] == 50.0
    assert math.isclose(second["port_exhaustion_eta_seconds"], (28232 - 500) / 50.0)


def test_malformed_and_missing_files_degrade_with_the_file_named(tmp_path: Path) -> None:
    root = _proc_tree(tmp_path, "TCP: garbage\n", port_range="not a range\n", tw_reuse="7\n")
    per_dest = {"10.0.0.7:8000": DestinationSockets(timewait=20, timewait_recent=2)}
    collector = TimewaitCollector(TimewaitConfig(), [], proc_root=root, diag=_diag(per_dest))
    snap = _collect(collector)
    status = collector.status()
    assert status.status is CollectorState.DEGRADED
    assert "sockstat" in status.reason and "ip_local_port_range" in status.reason
    assert "sockstat_tcp_tw" not in snap.host
    dest = snap.destinations["10.0.0.7:8000"]
    assert dest["timewait_sockets"] == 20 and "ephemeral_ports_available" not in dest


def test_sock_diag_failure_keeps_the_host_total(tmp_path: Path) -> None:
    root = _proc_tree(tmp_path, "TCP: inuse 1 orphan 0 tw 42 alloc 1 mem 1\n")

    def broken(**_kwargs: object) -> dict[str, DestinationSockets]:
        raise SockDiagError(93, "cannot open NETLINK_SOCK_DIAG: Protocol not supported")

    collector = TimewaitCollector(TimewaitConfig(), [], proc_root=root, diag=broken)
    snap = _collect(collector)
    assert snap.host["timewait_sockets"] == 42 and not snap.destinations
    assert "NETLINK_SOCK_DIAG" in collector.status().reason


def test_endpoint_formatting() -> None:
    assert format_endpoint(2, bytes([10, 0, 0, 7]), 8000) == "10.0.0.7:8000"
    assert format_endpoint(10, bytes(10) + b"\xff\xff" + bytes([127, 0, 0, 1]), 80) == "127.0.0.1:80"
    assert format_endpoint(10, bytes(15) + b"\x01", 443) == "[::1]:443"


class _CountingDiag:
    """A sock_diag stand-in that counts its dumps and answers ``counts[i]`` TIME_WAIT sockets
    to 10.0.0.7:8000 on its i-th dump (the last one repeats)."""

    def __init__(self, counts: list[int], fail_on: frozenset[int] = frozenset()) -> None:
        self.counts = counts
        self.fail_on = fail_on
        self.calls = 0

    def __call__(self, **_kwargs: object) -> dict[str, DestinationSockets]:
        self.calls += 1
        if self.calls in self.fail_on:
            raise SockDiagError(105, "No buffer space available")
        tw = self.counts[min(self.calls, len(self.counts)) - 1]
        return {"10.0.0.7:8000": DestinationSockets(timewait=tw, timewait_recent=tw // 10)}


def _sockstat(root: Path, tw: int) -> None:
    (root / "net/sockstat").write_text(f"TCP: inuse 1 orphan 0 tw {tw} alloc 1 mem 1\n")


def test_the_dump_runs_every_n_ticks_and_the_signals_are_there_every_tick(tmp_path: Path) -> None:
    root = _proc_tree(tmp_path, "TCP: inuse 1 orphan 0 tw 200 alloc 1 mem 1\n", tw_reuse="0\n")
    diag = _CountingDiag([100, 130, 160])
    collector = TimewaitCollector(TimewaitConfig(dump_every_ticks=3), [], proc_root=root, diag=diag)
    seen = [_collect(collector).destinations["10.0.0.7:8000"] for _ in range(7)]
    assert diag.calls == 3  # ticks 1, 4 and 7
    assert [d["timewait_sockets"] for d in seen] == [100, 100, 100, 130, 130, 130, 160]
    # every signal every tick: the repeated ticks give what their dump's tick gave
    assert all(set(d) == set(seen[0]) for d in seen)
    assert seen[1] == seen[0] and seen[5] == seen[3]
    assert seen[4]["port_exhaustion_eta_seconds"] == (28232 - 130) / 1.3


def test_a_jump_of_the_host_timewait_total_dumps_at_once(tmp_path: Path) -> None:
    root = _proc_tree(tmp_path, "TCP: inuse 1 orphan 0 tw 1000 alloc 1 mem 1\n")
    diag = _CountingDiag([100, 900])
    collector = TimewaitCollector(TimewaitConfig(dump_every_ticks=10), [], proc_root=root, diag=diag)
    _collect(collector)
    _sockstat(root, 1040)  # idle noise: under REDUMP_SOCKETS
    assert _collect(collector).destinations["10.0.0.7:8000"]["timewait_sockets"] == 100
    assert diag.calls == 1
    _sockstat(root, 1800)  # a storm starting
    assert _collect(collector).destinations["10.0.0.7:8000"]["timewait_sockets"] == 900
    assert diag.calls == 2


def test_a_new_backend_is_dumped_at_once(tmp_path: Path) -> None:
    root = _proc_tree(tmp_path, "TCP: inuse 1 orphan 0 tw 200 alloc 1 mem 1\n")
    diag = _CountingDiag([100])
    collector = TimewaitCollector(TimewaitConfig(dump_every_ticks=10), [], proc_root=root, diag=diag)
    _collect(collector)
    collector.set_backends([Backend.from_url("http://10.0.0.9:8000", name="vllm-9")])
    snap = _collect(collector)
    assert diag.calls == 2
    assert snap.destinations["10.0.0.9:8000"]["timewait_sockets"] == 0
    collector.set_backends([])  # a backend gone is no reason to dump
    _collect(collector)
    assert diag.calls == 2


def test_a_failed_dump_is_tried_again_the_next_tick(tmp_path: Path) -> None:
    root = _proc_tree(tmp_path, "TCP: inuse 1 orphan 0 tw 200 alloc 1 mem 1\n")
    diag = _CountingDiag([100, 100, 120], fail_on=frozenset({2}))
    collector = TimewaitCollector(TimewaitConfig(dump_every_ticks=2), [], proc_root=root, diag=diag)
    _collect(collector)
    _collect(collector)
    failed = _collect(collector)  # tick 3: due, fails
    assert "sock_diag dump failed" in collector.status().reason and not failed.destinations
    again = _collect(collector)  # tick 4: not waiting for the cadence
    assert diag.calls == 3 and again.destinations["10.0.0.7:8000"]["timewait_sockets"] == 120
    assert collector.status().status is CollectorState.OK


def test_the_bpf_entry_rate_is_fresh_between_dumps(tmp_path: Path) -> None:
    root = _proc_tree(tmp_path, "TCP: inuse 1 orphan 0 tw 200 alloc 1 mem 1\n", tw_reuse="0\n")
    diag = _CountingDiag([500])
    totals = {"10.0.0.7:8000": 1000}
    now = [0.0]
    collector = TimewaitCollector(TimewaitConfig(rate_window_seconds=10, dump_every_ticks=5), [], proc_root=root,
                                  clock=lambda: now[0], diag=diag, entry_source=lambda: totals)
    _collect(collector)
    now[0], totals["10.0.0.7:8000"] = 2.0, 1100
    second = _collect(collector).destinations["10.0.0.7:8000"]
    now[0], totals["10.0.0.7:8000"] = 4.0, 1400
    third = _collect(collector).destinations["10.0.0.7:8000"]
    assert diag.calls == 1
    assert second["timewait_entry_rate"] == 50.0 and third["timewait_entry_rate"] == 100.0
    assert third["port_exhaustion_eta_seconds"] == (28232 - 500) / 100.0


def test_dump_every_ticks_must_be_a_positive_integer() -> None:
    with pytest.raises(ValueError, match="dump_every_ticks"):
        TimewaitConfig(dump_every_ticks=0)

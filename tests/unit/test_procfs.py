"""The /proc collector on recorded trees, malformed trees, vanishing processes and the live /proc."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from llmdiag.agent.wiring import COLLECTOR_FACTORIES
from llmdiag.collectors.procfs import Malformed, ProcCollector, parse_psi, parse_sockstat, parse_task_state
from llmdiag.config import Config
from llmdiag.model import Backend, CollectorState, Sample, Scope, Snapshot

PROC = Path(__file__).resolve().parents[1] / "fixtures" / "proc"
RECORDED = PROC / "host618"
MALFORMED = PROC / "malformed"


def snapshot(samples: list[Sample]) -> Snapshot:
    snap = Snapshot(ts=0)
    snap.extend(samples)
    return snap


def backend(name: str, pid: int | None) -> Backend:
    return Backend(name, "http://127.0.0.1:8000", pid=pid)


def test_parse_task_state_reads_after_the_last_paren() -> None:
    assert parse_task_state(b"4110 (a) D (b) S 1 4100") == "S"
    assert parse_task_state(b"4112 (x) R (y) D 1 4100") == "D"
    assert parse_task_state(b"1 (systemd) S 0 1") == "S"
    with pytest.raises(Malformed):
        parse_task_state(b"4200 (trunc")
    with pytest.raises(Malformed):
        parse_task_state(b"")


def test_parse_psi_and_sockstat(shared_dir: Path) -> None:
    psi = parse_psi(b"some avg10=1.54 avg60=0.53 avg300=0.47 total=4427920\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    assert psi == {"some": pytest.approx(0.0154), "full": 0.0}
    tcp = parse_sockstat((shared_dir / "fixtures/host/host_proc_net_sockstat_kernel6.18.txt").read_bytes())
    assert tcp["inuse"] == 1 and tcp["tw"] == 1948
    tcp = parse_sockstat((shared_dir / "fixtures/host/node_exporter_fixture_proc_net_sockstat.txt").read_bytes())
    assert tcp == {"inuse": 4, "orphan": 0, "tw": 4, "alloc": 17, "mem": 1}
    with pytest.raises(Malformed):
        parse_sockstat(b"sockets: used 1\n")


def test_recorded_tree_host_and_process_signals() -> None:
    c = ProcCollector([backend("vllm-0", 4100), backend("no-pid", None)], proc_root=RECORDED, clock_ticks=100)
    snap = snapshot(c.collect(1.0))
    assert snap.host == {
        "psi_cpu_some_avg10": pytest.approx(0.0154),
        "psi_io_some_avg10": pytest.approx(0.125),
        "psi_io_full_avg10": pytest.approx(0.0825),
        "psi_memory_full_avg10": 0.0,
        "conntrack_entries": 1874,
        "conntrack_max": 262144,
        "sockstat_tcp_inuse": 1,
        "sockstat_tcp_tw": 1948,
    }
    p = snap.backends["vllm-0"]
    assert p["io_read_bytes_total"] == 0 and p["io_rchar_total"] == 6976 and p["io_write_bytes_total"] == 4096
    assert p["major_faults_total"] == 12
    assert p["cpu_seconds_total"] == pytest.approx((43210 + 1234) / 100)
    assert p["rss_bytes"] == 1776 * 1024
    assert p["mapped_file_bytes"] == (1752 - 108) * 1024  # smaps_rollup Rss - Anonymous
    assert p["swap_bytes"] == 0
    assert p["open_fds"] == 4
    # threads 4111 and 4112 are in D; 4110 and 4112 have ") X (" in their comm to trap naive parsers
    assert p["threads_dstate"] == 2
    assert "no-pid" not in snap.backends
    # Found nothing for one backend: not "ok", and the status says for which and why.
    st = c.status()
    assert st.status is CollectorState.DEGRADED and "no local process found for no-pid" in st.reason
    c = ProcCollector([backend("vllm-0", 4100)], proc_root=RECORDED, clock_ticks=100)
    c.collect(2.0)
    assert c.status().status is CollectorState.OK


def test_finding_nothing_is_degraded_with_the_reason(tmp_path: Path) -> None:
    c = ProcCollector([], proc_root=tmp_path)
    assert c.collect(1.0) == []
    st = c.status()
    assert st.status is CollectorState.DEGRADED and "no host signal" in st.reason and str(tmp_path) in st.reason


def test_no_backends_gives_host_signals_only() -> None:
    c = COLLECTOR_FACTORIES["proc"](Config.from_toml(f'[proc]\nproc_root = "{RECORDED}"\n'), [])
    samples = c.collect(1.0)
    assert samples and all(s.scope is Scope.HOST for s in samples)


def test_malformed_tree_gives_fallbacks_warnings_and_degraded(caplog: pytest.LogCaptureFixture) -> None:
    c = ProcCollector([backend("broken", 4200), backend("kthread", 4300)], proc_root=MALFORMED, clock_ticks=100)
    with caplog.at_level(logging.WARNING, logger="llmdiag.collectors.procfs"):
        snap = snapshot(c.collect(1.0))
    # pressure/cpu missing, io avg10 garbage, memory without avg10, sockstat without TCP, count not a number
    assert snap.host == {"conntrack_max": 65536}
    broken = snap.backends["broken"]
    assert broken["io_rchar_total"] == 12 and broken["io_write_bytes_total"] == 0
    assert "io_read_bytes_total" not in broken  # "many" is not a number: absent, not zero
    assert "cpu_seconds_total" not in broken and "mapped_file_bytes" not in broken and "rss_bytes" not in broken
    assert broken["threads_dstate"] == 1  # the empty task stat is skipped, 4201 is in D
    kthread = snap.backends["kthread"]
    assert kthread["cpu_seconds_total"] == pytest.approx(0.05) and "rss_bytes" not in kthread
    assert "mapped_file_bytes" not in kthread  # empty smaps_rollup
    st = c.status()
    assert st.status is CollectorState.DEGRADED
    for name in ("pressure/io", "pressure/memory", "net/sockstat", "nf_conntrack_count", "4200/stat", "4200/io", "4200/smaps_rollup"):
        assert name in st.reason, name
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "pressure/io" in warned and "4200/smaps_rollup" in warned
    # warnings are once per file, not once per tick
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="llmdiag.collectors.procfs"):
        c.collect(2.0)
    assert not caplog.records


def test_vanished_process_is_gone_not_an_error(tmp_path: Path) -> None:
    root = tmp_path / "proc"
    shutil.copytree(RECORDED, root)
    c = ProcCollector([backend("vllm-0", 4100), backend("never", 5555)], proc_root=root)
    snap = snapshot(c.collect(1.0))
    assert "vllm-0" in snap.backends and c.gone == {"never": 5555}
    shutil.rmtree(root / "4100")
    snap = snapshot(c.collect(2.0))
    assert "vllm-0" not in snap.backends and c.gone == {"vllm-0": 4100, "never": 5555}
    assert c.status().status is CollectorState.OK


def test_live_proc_of_this_test_process() -> None:
    # A thread blocked in read() on a pipe is in S, not D; the process has real IO and fds.
    c = ProcCollector([backend("me", os.getpid())])
    snap = snapshot(c.collect(1.0))
    me = snap.backends["me"]
    assert me["rss_bytes"] > 1 << 20
    assert me["cpu_seconds_total"] > 0
    assert me["open_fds"] >= 3
    assert me["io_rchar_total"] > 0
    assert me["threads_dstate"] >= 0 and me["mapped_file_bytes"] > 0
    fds_before = me["open_fds"]
    r, w = os.pipe()
    try:
        assert snapshot(c.collect(2.0)).backends["me"]["open_fds"] == fds_before + 2
    finally:
        os.close(r)
        os.close(w)
    if Path("/proc/pressure/io").exists():
        assert 0.0 <= snap.host["psi_io_some_avg10"] <= 1.0
    assert "sockstat_tcp_tw" in snap.host


def test_live_child_that_exits_is_gone() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: the pid no longer exists
    c = ProcCollector([backend("child", child.pid)])
    assert snapshot(c.collect(1.0)).backends == {}
    assert c.gone == {"child": child.pid}


def test_thread_cap_reads_the_lowest_tids() -> None:
    # tids 4100, 4110, 4111 (D) are read; 4112 (D) and 4113 are beyond the cap of 3.
    c = ProcCollector([backend("vllm-0", 4100)], proc_root=RECORDED, max_threads_per_process=3)
    assert snapshot(c.collect(1.0)).backends["vllm-0"]["threads_dstate"] == 1
    c = ProcCollector([backend("vllm-0", 4100)], proc_root=RECORDED, dstate_threads=False)
    assert "threads_dstate" not in snapshot(c.collect(1.0)).backends["vllm-0"]


def _set_state(stat: Path, state: str) -> None:
    head, _, tail = stat.read_text().rpartition(")")
    stat.write_text(f"{head}) {state}{tail[2:]}")


def test_slow_cadences_repeat_the_last_reading_between_reads(tmp_path: Path) -> None:
    root = tmp_path / "proc"
    shutil.copytree(RECORDED, root)
    c = ProcCollector([backend("vllm-0", 4100)], proc_root=root, dstate_every_ticks=3, smaps_rollup_every_ticks=2)
    first = snapshot(c.collect(1.0)).backends["vllm-0"]
    assert first["threads_dstate"] == 2 and first["mapped_file_bytes"] == (1752 - 108) * 1024
    _set_state(root / "4100/task/4113/stat", "D")  # a third thread blocks
    rollup = root / "4100/smaps_rollup"
    rollup.write_text(rollup.read_text().replace("Anonymous:           108 kB", "Anonymous:           208 kB"))
    seen = [snapshot(c.collect(float(t))).backends["vllm-0"] for t in (2, 3, 4)]
    # D-state scanned on ticks 1 and 4; smaps_rollup on ticks 1 and 3; the last reading in between.
    assert [s["threads_dstate"] for s in seen] == [2, 2, 3]
    assert [s["mapped_file_bytes"] // 1024 for s in seen] == [1752 - 108, 1752 - 208, 1752 - 208]
    # Every tick by default when built directly, and a new pid is read at once.
    assert snapshot(ProcCollector([backend("vllm-0", 4100)], proc_root=root).collect(1.0)).backends["vllm-0"]["threads_dstate"] == 3


def test_slow_cadence_keeps_a_malformed_reason_between_reads(tmp_path: Path) -> None:
    c = ProcCollector([backend("broken", 4200)], proc_root=MALFORMED, clock_ticks=100, smaps_rollup_every_ticks=5)
    for t in range(3):
        c.collect(float(t))
        assert "4200/smaps_rollup" in c.status().reason


def test_proc_cadence_config_defaults_and_checks() -> None:
    c = COLLECTOR_FACTORIES["proc"](Config.from_toml(f'[proc]\nproc_root = "{RECORDED}"\n'), [])
    assert (c.dstate_every_ticks, c.smaps_rollup_every_ticks) == (2, 60)
    c = COLLECTOR_FACTORIES["proc"](Config.from_toml("[proc]\ndstate_every_ticks = 1\nsmaps_rollup_every_ticks = 3\n"), [])
    assert (c.dstate_every_ticks, c.smaps_rollup_every_ticks) == (1, 3)
    with pytest.raises(ValueError, match="dstate_every_ticks must be >= 1"):
        Config.from_toml("[proc]\ndstate_every_ticks = 0\n")
    with pytest.raises(ValueError, match="smaps_every"):
        Config.from_toml("[proc]\nsmaps_every = 3\n")  # unknown keys stay errors


_HOLDER = "import os, sys; fds = [os.open('/dev/null', os.O_RDONLY) for _ in range({n})]; print('ready', flush=True); sys.stdin.read()"


def _holder(fds: int) -> subprocess.Popen[str]:
    """A live process blocked on its stdin (so its signals hold still) with ``fds`` extra descriptors open."""
    child = subprocess.Popen([sys.executable, "-c", _HOLDER.format(n=fds)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    return child


def _by_path(backends: list[Backend]) -> ProcCollector:
    c = ProcCollector(backends)
    c._kept = None  # what a recorded tree gets: every file opened by path each tick
    return c


def _stop(child: subprocess.Popen[str]) -> None:
    child.kill()
    child.wait()


def test_kept_descriptors_on_the_live_proc_read_what_paths_read_and_an_exit_is_gone() -> None:
    assert ProcCollector([], proc_root=RECORDED)._kept is None  # a recorded tree: by path
    child = _holder(5)
    try:
        kept = ProcCollector([backend("c", child.pid)])
        assert kept._kept is not None
        for now in (1.0, 2.0, 3.0):  # the first tick opens, the next ones pread the kept descriptors
            got = snapshot(kept.collect(now)).backends["c"]
            assert got == snapshot(_by_path([backend("c", child.pid)]).collect(now)).backends["c"]
        assert {"stat", "io", "statm", "fd"} <= {k[1] for k in kept._kept._fds if isinstance(k, tuple)}
        assert got["open_fds"] >= 5 + 3 and got["threads_dstate"] == 0
    finally:
        _stop(child)  # reaped: the kept descriptors now fail, and the path is gone
    assert "c" not in snapshot(kept.collect(4.0)).backends and kept.gone == {"c": child.pid}
    assert not [k for k in kept._kept._fds if isinstance(k, tuple)]
    assert kept.status().status is CollectorState.OK
    kept.close()
    assert len(kept._kept) == 0


def test_a_kept_descriptor_of_an_exited_process_never_reads_a_new_process_with_its_pid() -> None:
    old, new = _holder(0), _holder(9)
    try:
        c = ProcCollector([backend("x", old.pid)])
        c.collect(1.0)
        _stop(old)
        # The pid taken again by another process, as the collector sees it: the backend's pid
        # is `new.pid`, and the descriptors kept for it are the exited process's.
        assert c._kept is not None
        for name in ("stat", "io", "statm", "fd"):
            c._kept._fds[(new.pid, name)] = c._kept._fds.pop((old.pid, name))
        c.set_backends([backend("x", new.pid)])
        got = snapshot(c.collect(2.0)).backends["x"]
        assert got == snapshot(_by_path([backend("x", new.pid)]).collect(2.0)).backends["x"]
        assert got["open_fds"] >= 9 + 3 and c.gone == {}
    finally:
        _stop(new)


def test_a_multithreaded_live_process_is_scanned_thread_by_thread() -> None:
    # More than one thread: its D-state count comes from /proc/PID/task, as by path.
    c = ProcCollector([backend("me", os.getpid())])
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait)
    worker.start()
    try:
        got = snapshot(c.collect(1.0)).backends["me"]
        assert os.getpid() not in c._single_thread and got["threads_dstate"] >= 0
    finally:
        stop.set()
        worker.join()

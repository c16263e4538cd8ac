"""The CUDA allocation tracer with real uprobes, against a stand-in libcuda.so.1.

tests/fixtures/fake_libcuda/fake_libcuda.c exports the driver's memory entry
points with their real signatures; driver.py calls them from a subprocess (the
"backend process") one command at a time. A uprobe runs in the calling thread
before the call returns, so by the time the driver answers, the maps hold the
call: the counts below are exact, not eventually-consistent.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmdiag.collectors.cuda_alloc import CudaAllocCollector
from llmdiag.config.cuda import CudaConfig
from llmdiag.model import Backend, CollectorState, Sample, Scope, label_key

pytestmark = pytest.mark.root

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "fake_libcuda"
LIMIT = 64 << 20  # the stand-in's "device memory": larger requests fail with CUDA_ERROR_OUT_OF_MEMORY
OOM = 2
INVALID_VALUE = 1


def build_library(directory: Path, *defines: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / "libcuda.so.1"  # the driver's soname, so discovery by name finds it
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", *[f"-D{d}" for d in defines], "-o", str(out),
                    str(FIXTURE / "fake_libcuda.c"), "-lpthread"], check=True, capture_output=True, timeout=60)
    return out


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_library(tmp_path_factory.mktemp("full"))


class Driver:
    """A process calling the library, driven line by line (see driver.py)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(FIXTURE / "driver.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env={"FAKE_CUDA_MAX_ALLOC": str(LIMIT)})
        self.pid = self.proc.pid
        # A hung driver must not hang the suite: kill it after a minute.
        self._timer = threading.Timer(60, self.proc.kill)
        self._timer.daemon = True
        self._timer.start()

    def send(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline().strip()
        assert answer and not answer.startswith("error"), f"driver answered {answer!r} to {line!r}"
        return answer

    def alloc(self, api: str, size: int) -> tuple[int, int]:
        rc, value = self.send(f"alloc {api} {size}").split()
        return int(rc), int(value)

    def free(self, api: str, value: int) -> int:
        return int(self.send(f"free {api} {value}"))

    def exit(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write("exit\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=10)
        self._timer.cancel()

    def kill(self) -> None:
        self._timer.cancel()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def drivers() -> Iterator[list[Driver]]:
    started: list[Driver] = []
    yield started
    for d in started:
        d.kill()


def start(drivers: list[Driver]) -> Driver:
    d = Driver()
    drivers.append(d)
    return d


def by_name(samples: list[Sample], subject: str) -> dict[str, object]:
    return {s.name: s.value for s in samples if s.scope is Scope.BACKEND and s.subject == subject}


def host(samples: list[Sample]) -> dict[str, object]:
    return {s.name: s.value for s in samples if s.scope is Scope.HOST}


def backend(pid: int, name: str = "fake-0") -> Backend:
    return Backend(name=name, url="http://127.0.0.1:1", pid=pid)


def test_exact_counts_outstanding_bytes_and_histogram(library: Path, drivers: list[Driver]) -> None:
    engine = start(drivers)
    bystander = start(drivers)  # maps the same library, is no backend: must not be counted
    for d in (engine, bystander):
        assert d.send(f"load {library}") == "ok"
    rc, early = engine.alloc("alloc", 777)  # before tracing: its free is "untracked"
    assert rc == 0

    collector = CudaAllocCollector(CudaConfig(), [backend(engine.pid)])
    try:
        status = collector.status()
        assert status.status is CollectorState.OK, status.reason
        assert "cuMemAlloc_v2, cuMemAllocAsync, cuMemCreate, cuMemFree_v2, cuMemFreeAsync, cuMemRelease" in status.reason

        sizes = [1000, 4096, 4097, 1 << 20, 3 << 20]  # N successful cuMemAlloc_v2
        values = []
        for size in sizes:
            rc, value = engine.alloc("alloc", size)
            assert rc == 0
            values.append(value)
        for i in (0, 2):  # K frees
            assert engine.free("free", values[i]) == 0
        failing = [LIMIT + 1, 1 << 30, 5 << 30]  # F out-of-memory allocations
        for size in failing:
            assert engine.alloc("alloc", size) == (OOM, 0)
        assert engine.free("free", 12345) == INVALID_VALUE  # a free the driver refuses
        assert engine.free("free", early) == 0  # allocated before tracing began
        rc, a1 = engine.alloc("async", 2048)
        rc2, a2 = engine.alloc("async", 512)
        assert (rc, rc2) == (0, 0)
        assert engine.free("async", a1) == 0
        assert engine.free("free", a2) == 0  # cuMemFree_v2 may free cuMemAllocAsync memory
        rc, handle = engine.alloc("create", 2 << 20)
        assert rc == 0
        assert engine.alloc("create", LIMIT * 2) == (OOM, 0)
        assert engine.free("release", handle) == 0
        assert engine.alloc("create", 4 << 20)[0] == 0  # kept: still live when the process exits
        # 4 threads x 25 allocations of 256 B, each frees all but its last: uprobes see every thread.
        assert engine.send("burst 4 25 256") == "ok"
        for size in (100, 200):
            assert bystander.alloc("alloc", size)[0] == 0

        samples = collector.collect(1000.0)
        got = by_name(samples, "fake-0")
        allocs = len(sizes) + 2 + 2 + 100
        assert got["cuda_alloc_total"] == allocs
        assert got["cuda_free_total"] == 2 + 1 + 2 + 1 + 96
        assert got["cuda_alloc_failures_total"] == len(failing) + 1
        assert got["cuda_alloc_failures_by_code_total"] == {label_key(code=OOM): 4}
        assert got["cuda_free_failures_total"] == 1
        assert got["cuda_free_untracked_total"] == 1
        alloc_bytes = sum(sizes) + 2048 + 512 + (2 << 20) + (4 << 20) + 100 * 256
        assert got["cuda_alloc_bytes_total"] == alloc_bytes
        freed = sizes[0] + sizes[2] + 2048 + 512 + (2 << 20) + 96 * 256
        assert got["cuda_free_bytes_total"] == freed
        assert got["cuda_outstanding_bytes"] == {label_key(pid=engine.pid): alloc_bytes - freed}
        assert alloc_bytes - freed == sizes[1] + sizes[3] + sizes[4] + (4 << 20) + 4 * 256
        assert got["cuda_traced_processes"] == 1
        assert got["cuda_api_calls_total"] == {
            label_key(api="cuMemAlloc_v2", code=0): len(sizes) + 100,
            label_key(api="cuMemAlloc_v2", code=OOM): len(failing),
            label_key(api="cuMemFree_v2", code=0): 2 + 1 + 1 + 96,
            label_key(api="cuMemFree_v2", code=INVALID_VALUE): 1,
            label_key(api="cuMemAllocAsync", code=0): 2,
            label_key(api="cuMemFreeAsync", code=0): 1,
            label_key(api="cuMemCreate", code=0): 2,
            label_key(api="cuMemCreate", code=OOM): 1,
            label_key(api="cuMemRelease", code=0): 1,
        }
        # Histogram bounds are powers of two, cumulative: 256 B x100 <= 2^8, 512 <= 2^9, 1000 <= 2^10,
        # 2048 <= 2^11, 4096 <= 2^12, 4097 <= 2^13, 1 MiB = 2^20, 2 MiB = 2^21, 3 MiB and 4 MiB <= 2^22.
        hist = got["cuda_alloc_size_bytes"]
        assert hist[label_key(le=256)] == 100
        assert hist[label_key(le=512)] == 101
        assert hist[label_key(le=1024)] == 102
        assert hist[label_key(le=2048)] == 103
        assert hist[label_key(le=4096)] == 104
        assert hist[label_key(le=8192)] == 105
        assert hist[label_key(le=1 << 19)] == 105
        assert hist[label_key(le=1 << 20)] == 106
        assert hist[label_key(le=1 << 21)] == 107
        assert hist[label_key(le=1 << 22)] == 109
        assert hist[label_key(le="+Inf")] == allocs
        assert label_key(le=128) not in hist and label_key(le=1 << 23) not in hist
        assert host(samples) == {"cuda_tracer_map_full_total": 0, "cuda_tracer_read_errors_total": 0}
        traced_pids = {pid for pid, _ in collector.program.read_hash("pid_stats")}
        assert traced_pids == {engine.pid}  # the bystander's calls hit no probe of ours

        # The engine exits: its counters stay (they are totals), its outstanding bytes go.
        engine.exit()
        after = by_name(collector.collect(1001.0), "fake-0")
        assert after["cuda_alloc_total"] == allocs
        assert after["cuda_free_total"] == got["cuda_free_total"]
        assert after["cuda_alloc_failures_by_code_total"] == {label_key(code=OOM): 4}
        assert after["cuda_api_calls_total"] == got["cuda_api_calls_total"]
        assert after["cuda_alloc_size_bytes"] == hist
        assert after["cuda_outstanding_bytes"] == {}
        assert after["cuda_traced_processes"] == 0
        assert collector.program.read_hash("pid_stats") == []  # retired: map entries freed
        assert collector.program.read_hash("live_allocs") == []
        assert not collector.program.bpf.uprobe_fds  # its probes detached
    finally:
        collector.close()
    assert collector.status().status is CollectorState.UNAVAILABLE
    collector.close()  # idempotent


def test_waits_for_libcuda_and_traces_child_processes(library: Path, drivers: list[Driver]) -> None:
    server = start(drivers)  # the API server: never loads CUDA itself
    config = CudaConfig(rescan_seconds=5.0)
    collector = CudaAllocCollector(config, [backend(server.pid, "vllm-0")])
    try:
        status = collector.status()
        assert status.status is CollectorState.DEGRADED
        assert "no backend process maps libcuda.so yet" in status.reason
        assert by_name(collector.collect(100.0), "vllm-0") == {}  # nothing traced: no made-up zeros

        child_pid = int(server.send("spawn"))  # the engine core, as vLLM starts it
        assert server.send(f"load {library}") == "ok"  # relayed to the child
        collector.collect(102.0)
        assert collector.status().status is CollectorState.DEGRADED  # not re-checked before rescan_seconds
        assert by_name(collector.collect(105.0), "vllm-0")["cuda_traced_processes"] == 1
        assert collector.status().status is CollectorState.OK

        for size in (1 << 20, 2 << 20):
            assert server.alloc("alloc", size)[0] == 0
        assert server.alloc("alloc", LIMIT + 1) == (OOM, 0)
        got = by_name(collector.collect(106.0), "vllm-0")
        assert got["cuda_alloc_total"] == 2
        assert got["cuda_alloc_failures_total"] == 1
        assert got["cuda_outstanding_bytes"] == {label_key(pid=child_pid): 3 << 20}
    finally:
        collector.close()


def test_attaches_only_to_symbols_the_library_exports(tmp_path: Path, drivers: list[Driver]) -> None:
    old_driver = build_library(tmp_path / "old", "FAKE_CUDA_NO_ASYNC", "FAKE_CUDA_NO_VMM")
    engine = start(drivers)
    assert engine.send(f"load {old_driver}") == "ok"
    collector = CudaAllocCollector(CudaConfig(), [backend(engine.pid)])
    try:
        status = collector.status()
        assert status.status is CollectorState.OK
        assert status.reason.startswith("uprobes on cuMemAlloc_v2, cuMemFree_v2 in 1 process")
        assert len(collector.program.bpf.uprobe_fds) == 4  # entry + return on each of the two
        rc, value = engine.alloc("alloc", 4096)
        assert rc == 0 and engine.free("free", value) == 0
        got = by_name(collector.collect(1.0), "fake-0")
        assert (got["cuda_alloc_total"], got["cuda_free_total"], got["cuda_outstanding_bytes"]) == (
            1, 1, {label_key(pid=engine.pid): 0})
    finally:
        collector.close()


def test_full_live_map_is_counted_and_degrades(library: Path, drivers: list[Driver]) -> None:
    engine = start(drivers)
    assert engine.send(f"load {library}") == "ok"
    collector = CudaAllocCollector(CudaConfig(max_live_allocations=64), [backend(engine.pid)])
    try:
        for _ in range(70):
            assert engine.alloc("alloc", 1024)[0] == 0
        samples = collector.collect(1.0)
        got = by_name(samples, "fake-0")
        assert got["cuda_alloc_total"] == 70  # still counted...
        assert got["cuda_outstanding_bytes"] == {label_key(pid=engine.pid): 64 * 1024}  # ...not tracked
        assert host(samples)["cuda_tracer_map_full_total"] == 6
        status = collector.status()
        assert status.status is CollectorState.DEGRADED and "6 map-full failures" in status.reason
    finally:
        collector.close()


def test_backend_without_pid_is_found_by_its_listening_port(library: Path, drivers: list[Driver]) -> None:
    engine = start(drivers)
    port = int(engine.send("listen"))
    unrelated = Backend(name="remote", url=f"http://10.255.0.1:{port}")  # same port, another host: not ours
    collector = CudaAllocCollector(CudaConfig(), [Backend.from_url(f"http://127.0.0.1:{port}", name="local"), unrelated])
    try:
        assert "no backend process maps libcuda.so yet" in collector.status().reason  # found, no CUDA yet
        assert engine.send(f"load {library}") == "ok"
        collector.collect(10.0)  # the first collect re-checks at once
        assert engine.alloc("alloc", 4096)[0] == 0
        samples = collector.collect(11.0)
        assert by_name(samples, "local")["cuda_outstanding_bytes"] == {label_key(pid=engine.pid): 4096}
        assert by_name(samples, "remote") == {}
    finally:
        collector.close()


def test_a_process_whose_size_did_not_change_is_not_read_again_until_it_loads_the_driver(
    library: Path, drivers: list[Driver], monkeypatch: pytest.MonkeyPatch,
) -> None:
    from llmdiag.collectors import cuda_alloc

    reads: list[int] = []
    real = cuda_alloc.find_library

    def counting(tgid, *args):  # noqa: ANN001, ANN202
        reads.append(tgid)
        return real(tgid, *args)

    monkeypatch.setattr(cuda_alloc, "find_library", counting)
    engine = start(drivers)
    collector = CudaAllocCollector(CudaConfig(rescan_seconds=5.0), [backend(engine.pid, "vllm-0")])
    try:
        assert reads.count(engine.pid) == 1  # the first scan reads its maps: no driver yet
        collector.collect(100.0)
        collector.collect(105.0)
        collector.collect(110.0)
        assert reads.count(engine.pid) == 1  # same virtual size since: its maps are not read again
        assert engine.send(f"load {library}") == "ok"  # the driver arrives: the address space grows
        assert by_name(collector.collect(115.0), "vllm-0")["cuda_traced_processes"] == 1
        assert reads.count(engine.pid) == 2
    finally:
        collector.close()

"""Collectors own their attach points (read from their BPF programs) and nvml.py owns NVML: what doctor calls."""

from __future__ import annotations

import re

from llmdiag.bpf.loader import BPF_DIR, program_tracepoints
from llmdiag.collectors import cuda_alloc, http2, tcp
from llmdiag.collectors.attach_points import all_attach_points
from llmdiag.collectors.nvml import probe_nvml
from llmdiag.collectors.nvml_replay import ReplayNvml


def test_each_program_tracepoint_is_declared_by_its_collector() -> None:
    for name, collector in (("tcp_health", "tcp"), ("http2_frames", "http2")):
        source = (BPF_DIR / f"{name}.bpf.c").read_text()
        in_source = {m.group(1) + ":" + m.group(2) for m in re.finditer(r"^TRACEPOINT_PROBE\((\w+), (\w+)\)", source, re.M)}
        declared = {a.target for a in all_attach_points() if a.collector == collector and a.kind == "tracepoint"}
        assert in_source and declared == in_source


def test_tcp_needs_inet_sock_set_state_and_never_listed_tcp_sendmsg_locked() -> None:
    points = {a.target: a for a in tcp.attach_points()}
    assert points["sock:inet_sock_set_state"].required
    assert "tcp:tcp_sendmsg_locked" not in points  # it carries no socket: the program does not use it
    assert points["tcp_sendmsg"].kind == "kprobe" and not points["tcp_sendmsg"].required
    assert ("raw", "sock_send_length") in program_tracepoints("tcp_health")


def test_http2_and_cuda_points() -> None:
    assert all(a.required for a in http2.attach_points())
    cuda = {a.target: a.required for a in cuda_alloc.attach_points()}
    assert cuda["libcuda.so:cuMemAlloc_v2"] and cuda["libcuda.so:cuMemFree_v2"] and not cuda["libcuda.so:cuMemCreate"]


def test_present_answers_from_this_kernel() -> None:
    point = next(a for a in tcp.attach_points() if a.target == "sock:inet_sock_set_state")
    assert point.present() in (True, False)
    assert next(a for a in tcp.attach_points() if a.kind == "raw_tracepoint").present() is None


def _replay(**doc) -> ReplayNvml:
    return ReplayNvml({"format": "llmdiag.nvml-replay/v1", "devices": [], "ticks": [{}], **doc})


def test_probe_nvml_reports_a_driver_or_why_not() -> None:
    missing = probe_nvml(_replay(init_error="NVML_ERROR_LIBRARY_NOT_FOUND"))
    assert not missing.ok and missing.absent and "libnvidia-ml.so.1" in missing.hint
    broken = probe_nvml(_replay(init_error="NVML_ERROR_DRIVER_NOT_LOADED"))
    assert not broken.ok and not broken.absent and "DRIVER_NOT_LOADED" in broken.reason
    fine = probe_nvml(_replay(driver_version="550.54.15"))
    assert fine.ok and fine.driver_version == "550.54.15" and fine.device_count == 0

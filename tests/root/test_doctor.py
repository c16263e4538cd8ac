"""``llmdiag doctor --json`` on the real host, checked against independent sources."""

from __future__ import annotations

import ctypes.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.root


@pytest.fixture(scope="module")
def doctor() -> tuple[int, dict[str, dict[str, str]]]:
    proc = subprocess.run([sys.executable, "-m", "llmdiag.cli", "doctor", "--json"],
                          capture_output=True, text=True, timeout=120)
    doc = json.loads(proc.stdout)
    for check in doc["checks"]:
        assert set(check) == {"name", "status", "detail", "hint", "optional"}
        assert check["status"] in {"ok", "degraded", "unavailable"}
        if check["status"] != "ok":
            assert check["hint"], f"{check['name']} is {check['status']} without a hint"
    return proc.returncode, {c["name"]: c for c in doc["checks"]}


def test_collectors_can_run_here(doctor: tuple[int, dict[str, dict[str, str]]]) -> None:
    rc, checks = doctor
    assert rc == 0, checks
    for name in ("bpf_syscall", "tracefs", "bcc", "uprobe"):
        assert checks[name]["status"] == "ok", checks[name]


def test_tracepoints_match_tracefs(doctor: tuple[int, dict[str, dict[str, str]]]) -> None:
    _, checks = doctor
    tracefs = Path("/sys/kernel/tracing/events")
    tracepoints = {n: c for n, c in checks.items() if n.startswith("tracepoint:")}
    assert len(tracepoints) >= 8
    for name, check in tracepoints.items():
        _, category, event = name.split(":")
        assert (check["status"] == "ok") == (tracefs / category / event).is_dir(), name


def test_kprobe_and_fentry_reported_as_the_kernel_has_them(doctor: tuple[int, dict[str, dict[str, str]]]) -> None:
    _, checks = doctor
    has_kprobes = Path("/sys/bus/event_source/devices/kprobe").is_dir()
    assert (checks["kprobe"]["status"] == "ok") == has_kprobes
    if not has_kprobes:  # this Firecracker kernel: kprobes compiled out, fentry attach EPERM
        assert checks["kprobe"]["status"] == "unavailable"
        assert checks["fentry"]["status"] == "unavailable"
        assert checks["fentry"]["detail"].startswith("fentry attach failed: ")


def test_nvml_unavailable_has_a_hint_without_a_driver(doctor: tuple[int, dict[str, dict[str, str]]]) -> None:
    _, checks = doctor
    if ctypes.util.find_library("nvidia-ml") or os.path.exists("/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"):
        pytest.skip("an NVIDIA driver is installed here")
    assert checks["nvml"]["status"] == "unavailable"
    assert "driver" in checks["nvml"]["hint"]

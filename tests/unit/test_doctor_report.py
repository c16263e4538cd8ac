"""``llmdiag doctor`` for the users who need it most: not root, on a narrow terminal, with a backend to check."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from engine_http import SHARED_ENGINES, metrics_server
from rich.console import Console

from llmdiag.cli import doctor
from llmdiag.cli.doctor import DEGRADED, OK, UNAVAILABLE, Check
from llmdiag.cli.main import main

REPO = Path(__file__).resolve().parents[2]


def _as_nobody() -> list[str]:
    """A command prefix that runs as an unprivileged user: `setpriv` when root, nothing otherwise."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) is not installed")
    prefix = [setpriv, "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
    probe = subprocess.run([*prefix, sys.executable, "-c", "import llmdiag.cli.doctor"], capture_output=True,
                           text=True, timeout=60, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    if probe.returncode != 0:
        pytest.skip(f"user nobody cannot read this checkout: {probe.stderr.strip().splitlines()[-1:]}")
    return prefix


def test_doctor_as_a_non_root_user_reports_instead_of_crashing() -> None:
    proc = subprocess.run([*_as_nobody(), sys.executable, "-m", "llmdiag.cli", "doctor", "--json"],
                          capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO), "HOME": "/tmp"})
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 1, proc.stdout + proc.stderr  # BPF collectors cannot run without privileges
    doc = json.loads(proc.stdout)
    checks = {c["name"]: c for c in doc["checks"]}
    assert doc["collectors_can_run"] is False
    for check in checks.values():
        assert set(check) == {"name", "status", "detail", "hint", "optional"}
        if check["status"] != OK:
            assert check["hint"], check
    assert checks["privileges"]["status"] == UNAVAILABLE and "CAP_BPF" in checks["privileges"]["hint"]
    optional = {n for n, c in checks.items() if c["optional"]}
    assert optional >= {"btf", "kprobe", "fentry", "bpf_stats"}
    assert all(n.startswith(("raw_tracepoint:", "kprobe:")) for n in optional - {"btf", "kprobe", "fentry", "bpf_stats"})
    denied = subprocess.run([*_as_nobody(), sys.executable, "-c", "import pathlib; pathlib.Path('/sys/kernel/tracing/events').is_dir()"],
                            capture_output=True, text=True, timeout=60, env={**os.environ, "HOME": "/tmp"}).returncode != 0
    if denied:  # tracefs is 0700 root on most kernels: "needs root", never "missing" or "not mounted"
        assert checks["tracefs"]["detail"].startswith("needs root/CAP_BPF"), checks["tracefs"]
        assert "sudo llmdiag doctor" in checks["tracefs"]["hint"]
        looked_up = [c for n, c in checks.items() if n.startswith(("tracepoint:", "kprobe:", "uprobe:"))]
        assert looked_up and all(c["detail"].startswith("needs root") for c in looked_up), looked_up


def test_the_collectors_can_run_when_the_base_and_the_tcp_attach_points_work() -> None:
    from llmdiag.collectors import tcp

    core = [f"{n.kind}:{n.target}" for n in tcp.attach_points() if n.required]
    assert core == ["tracepoint:sock:inet_sock_set_state"]  # as the tcp collector declares it
    required = [Check(n, OK, "") for n in ("bpf_syscall", "tracefs", "bcc", "kernel_headers", *core)]
    assert doctor.collectors_can_run(required)
    assert not doctor.collectors_can_run(required[1:])  # bpf_syscall could not even be probed
    assert not doctor.collectors_can_run([*required[:-1], Check(core[0], UNAVAILABLE, "missing")])


def test_attach_points_come_from_the_collectors() -> None:
    from llmdiag.collectors.attach_points import all_attach_points

    checks = doctor._attach_points()  # noqa: SLF001
    assert [c.name for c in checks] == [f"{n.kind}:{n.target}" for n in all_attach_points()]
    assert "tracepoint:tcp:tcp_sendmsg_locked" not in {c.name for c in checks}  # doctor's old copy had it
    for check in checks:
        if check.status != OK:
            assert check.hint, check
    kprobe = next(c for c in checks if c.name == "kprobe:tcp_sendmsg")
    assert kprobe.optional  # a fallback, never a gap


def _render(checks: list[Check], can_run: bool, width: int = 80) -> str:
    console = Console(width=width, record=True, force_terminal=False, highlight=False)
    doctor._print_report(checks, can_run, console=console)  # noqa: SLF001
    return console.export_text()


def test_the_report_is_readable_at_80_columns_and_prints_brackets_as_written() -> None:
    checks = [
        Check("kernel", OK, "Linux 6.8.0 (x86_64)"),
        Check("bpf_syscall", UNAVAILABLE, "bpf(BPF_MAP_CREATE) failed: Operation not permitted " * 3,
              "needs CAP_BPF; add a [[backends]] entry or pass --backend [::1]:8000"),
        *[Check(f"tracepoint:tcp:tp{i}", OK, "present (tcp: something)") for i in range(8)],
        Check("tracepoint:tcp:tcp_probe", DEGRADED, "missing (tcp: sampled srtt)", "the signal it feeds will be missing"),
        Check("kprobe", UNAVAILABLE, "kernel built without kprobes", "not needed", optional=True),
        Check("nvml", UNAVAILABLE, "NVML could not start", "no NVIDIA driver here"),
    ]
    text = _render(checks, can_run=False)
    lines = text.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 80
    assert "[[backends]]" in text and "[::1]:8000" in text  # not eaten as rich markup
    assert "all 8 present" not in text and "8 present (used by tcp)" in text  # folded, the missing one listed
    first = next(i for i, line in enumerate(lines) if line.startswith(" no bpf_syscall"))
    assert lines[first + 1].startswith("    failed") or lines[first + 1].startswith("    bpf")  # wrapped under the text
    assert any(line.startswith(" -- kprobe") for line in lines)  # an absent upgrade is not a gap ("no")
    assert any(line.startswith("    -> needs CAP_BPF") for line in lines)  # the hint under its check


def test_doctor_checks_that_each_backend_answers(capsys: pytest.CaptureFixture[str]) -> None:
    body = (SHARED_ENGINES / "vllm_SYNTHETIC_current_v1_names_text0.0.4.prom").read_text()
    with metrics_server(body) as server, metrics_server("<html>not metrics</html>") as html:
        with metrics_server("x") as dead:
            dead_url = dead.url
        main(["doctor", "--json", "--backend", server.url, "--backend", dead_url, "--backend", html.url])
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    good, down, other = (checks[f"backend:{u.removeprefix('http://')}"] for u in (server.url, dead_url, html.url))
    assert good["status"] == OK and "vllm" in good["detail"], good
    assert down["status"] == UNAVAILABLE and "connection refused" in down["detail"] and down["hint"], down
    assert other["status"] != OK and other["hint"], other

"""``llmdiag doctor``: what works on this host, and what to do about each gap.

Every check has a status (``ok``, ``degraded``, ``unavailable``), a detail
(what was found) and a hint (what to do). ``--json`` prints
``{"checks": [{"name", "status", "detail", "hint"}], "collectors_can_run": bool}``.
The exit code is 0 when the BPF collectors can run (bpf(2), bcc, kernel
headers, tracefs and the core TCP tracepoints all work) and 1 otherwise;
engine, /proc and GPU collectors need none of that.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from collections.abc import Callable
from dataclasses import asdict, dataclass

from llmdiag.bpf import features
from llmdiag.config import Config

OK, DEGRADED, UNAVAILABLE = "ok", "degraded", "unavailable"

#: Tracepoints the collectors use (SPEC section 2), and which collector needs each.
TRACEPOINTS = (
    ("sock", "inet_sock_set_state", "tcp: connection lifecycle, TIME_WAIT entries"),
    ("tcp", "tcp_sendmsg_locked", "tcp: sends (kprobe tcp_sendmsg on older kernels)"),
    ("sock", "sock_send_length", "tcp: bytes sent per socket"),
    ("tcp", "tcp_retransmit_skb", "tcp: retransmits"),
    ("tcp", "tcp_send_reset", "tcp: resets sent"),
    ("tcp", "tcp_receive_reset", "tcp: resets received"),
    ("tcp", "tcp_probe", "tcp: sampled srtt"),
    ("sock", "sock_exceed_buf_limit", "tcp: socket memory pressure"),
    ("syscalls", "sys_enter_sendmsg", "http2: frames sent"),
    ("syscalls", "sys_enter_sendto", "http2: frames sent"),
    ("syscalls", "sys_enter_write", "http2: frames sent"),
    ("syscalls", "sys_enter_writev", "http2: frames sent"),
    ("syscalls", "sys_exit_recvmsg", "http2: frames received"),
    ("syscalls", "sys_exit_recvfrom", "http2: frames received"),
    ("syscalls", "sys_exit_read", "http2: frames received"),
    ("syscalls", "sys_exit_readv", "http2: frames received"),
)
#: Without these the TCP collector cannot run at all.
CORE_TRACEPOINTS = {("sock", "inet_sock_set_state"), ("tcp", "tcp_sendmsg_locked")}


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str
    hint: str = ""


def _kernel() -> Check:
    release = os.uname().release
    major, minor = (int(x) for x in release.split(".")[:2])
    if (major, minor) < (4, 18):
        return Check("kernel", DEGRADED, f"Linux {release}", "kernels before 4.18 lack sock tracepoints; upgrade")
    return Check("kernel", OK, f"Linux {release} ({platform.machine()})")


def _root() -> list[Check]:
    caps = features.capabilities()
    have = [c for c, on in caps.items() if on]
    missing = [c for c in ("CAP_BPF", "CAP_PERFMON", "CAP_NET_ADMIN", "CAP_SYS_PTRACE") if not caps[c]]
    privileged = os.geteuid() == 0 or (caps["CAP_BPF"] and caps["CAP_PERFMON"]) or caps["CAP_SYS_ADMIN"]
    status = OK if privileged and not missing else (DEGRADED if privileged else UNAVAILABLE)
    return [
        Check(
            "privileges",
            status,
            f"uid {os.geteuid()}; effective capabilities: {', '.join(have) or 'none'}",
            "" if status == OK else f"run as root or grant {', '.join(missing)} (see deploy/ for the DaemonSet)",
        )
    ]


def _bpf_syscall() -> Check:
    probe = features.bpf_syscall_available()
    return Check(
        "bpf_syscall", OK if probe else UNAVAILABLE, probe.detail,
        "" if probe else "needs CONFIG_BPF_SYSCALL and CAP_BPF (or root); check kernel.unprivileged_bpf_disabled",
    )


def _btf() -> Check:
    probe = features.btf_available()
    return Check("btf", OK if probe else DEGRADED, probe.detail,
                 "" if probe else "fentry/CO-RE upgrades need BTF; the tracepoint collectors do not")


def _tracefs() -> Check:
    root, what = features.ensure_tracefs()
    return Check("tracefs", OK if root else UNAVAILABLE, what,
                 "" if root else "mount -t tracefs tracefs /sys/kernel/tracing (needs root)")


def _tracepoints() -> list[Check]:
    checks = []
    for category, event, used_for in TRACEPOINTS:
        exists = features.tracepoint_exists(category, event)
        core = (category, event) in CORE_TRACEPOINTS
        status = OK if exists else (UNAVAILABLE if core else DEGRADED)
        hint = ""
        if not exists:
            hint = "kprobe tcp_sendmsg is used instead where kprobes exist" if event == "tcp_sendmsg_locked" else (
                "the signal it feeds will be missing on this kernel")
        checks.append(Check(f"tracepoint:{category}:{event}", status, f"{'present' if exists else 'missing'} ({used_for})", hint))
    return checks


def _kprobes() -> Check:
    probe = features.kprobes_supported()
    return Check("kprobe", OK if probe else UNAVAILABLE, probe.detail,
                 "" if probe else "not needed here: the collectors attach to tracepoints first")


def _fentry(bcc_ok: bool) -> Check:
    if not bcc_ok:
        return Check("fentry", UNAVAILABLE, "not probed: bcc is not importable", "install python3-bpfcc")
    probe = features.fentry_supported()
    return Check("fentry", OK if probe else UNAVAILABLE, probe.detail,
                 "" if probe else "not needed: fentry is only an optional upgrade over tracepoints")


def _uprobes() -> Check:
    probe = features.uprobes_supported()
    return Check("uprobe", OK if probe else UNAVAILABLE, probe.detail,
                 "" if probe else "the CUDA allocation tracer needs CONFIG_UPROBE_EVENTS")


def _headers() -> Check:
    probe = features.kernel_headers()
    if not probe:
        return Check("kernel_headers", UNAVAILABLE, probe.detail,
                     "run scripts/setup.sh (installs linux-headers and links them), or install linux-headers-$(uname -r)")
    fallback = probe.detail.startswith("fallback")
    return Check("kernel_headers", DEGRADED if fallback else OK, probe.detail,
                 "generic headers: tracepoint programs are fine; kernel struct reads are avoided" if fallback else "")


def _bcc() -> Check:
    probe = features.bcc_available()
    return Check("bcc", OK if probe else UNAVAILABLE, probe.detail,
                 "" if probe else "apt-get install python3-bpfcc; make the venv with --system-site-packages")


def _bpf_stats() -> Check:
    probe = features.bpf_stats_enabled()
    return Check("bpf_stats", OK if probe else DEGRADED, probe.detail,
                 "" if probe else "sysctl kernel.bpf_stats_enabled=1 to measure in-kernel cost (llmdiag bench)")


def _nvml() -> Check:
    try:
        import pynvml  # noqa: PLC0415 - optional at run time
    except ImportError:
        return Check("nvml", UNAVAILABLE, "nvidia-ml-py is not installed", "pip install nvidia-ml-py")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return Check("nvml", UNAVAILABLE, f"NVML could not start: {exc}",
                     "no NVIDIA driver here: GPU signals are skipped (install the driver / use the NVIDIA container runtime)")
    try:
        count = pynvml.nvmlDeviceGetCount()
        driver = pynvml.nvmlSystemGetDriverVersion()
    finally:
        pynvml.nvmlShutdown()
    return Check("nvml", OK if count else DEGRADED, f"driver {driver}, {count} GPU(s)",
                 "" if count else "NVML works but sees no GPU")


def _engines(config: Config) -> Check:
    try:
        from llmdiag.collectors.discovery import discover_engines  # noqa: PLC0415
    except ImportError:
        return Check("engines", UNAVAILABLE, "engine discovery is not available in this build", "pass engines with --backend URL")
    configured = config.backend_list()
    try:
        found = discover_engines()
    except Exception as exc:  # noqa: BLE001 - doctor reports, never crashes
        return Check("engines", DEGRADED, f"discovery failed: {exc}", "pass engines with --backend URL")
    names = [f"{b.engine or '?'} at {b.url}" + (f" (pid {b.pid})" if b.pid else "") for b in found]
    detail = f"{len(found)} engine(s) on local listening ports" + (f": {'; '.join(names)}" if names else "")
    if configured:
        detail += f"; {len(configured)} configured"
    if not found and not configured:
        return Check("engines", DEGRADED, detail,
                     "no vLLM/SGLang/TRT-LLM/Triton/TGI /metrics found; pass --backend URL or run llmdiag fake-engine")
    return Check("engines", OK, detail)


def run_checks(config: Config) -> list[Check]:
    checks: list[Check] = [_kernel()]
    checks += _root()
    checks.append(_bpf_syscall())
    checks.append(_btf())
    checks.append(_tracefs())
    checks += _tracepoints()
    checks.append(_kprobes())
    bcc = _bcc()
    checks.append(_uprobes())
    checks.append(_headers())
    checks.append(bcc)
    checks.append(_fentry(bcc.status == OK))
    checks.append(_bpf_stats())
    checks.append(_nvml())
    checks.append(_engines(config))
    return checks


def collectors_can_run(checks: list[Check]) -> bool:
    by_name = {c.name: c for c in checks}
    needed = ["bpf_syscall", "tracefs", "bcc", "kernel_headers"] + [f"tracepoint:{c}:{e}" for c, e in sorted(CORE_TRACEPOINTS)]
    return all(by_name[n].status != UNAVAILABLE for n in needed)


def _print_table(checks: list[Check], can_run: bool) -> None:
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    colours = {OK: "green", DEGRADED: "yellow", UNAVAILABLE: "red"}
    table = Table(title="llmdiag doctor", show_lines=False)
    table.add_column("check", style="bold", no_wrap=True)
    table.add_column("status")
    table.add_column("detail", overflow="fold")
    table.add_column("what to do", overflow="fold")
    for c in checks:
        table.add_row(c.name, f"[{colours[c.status]}]{c.status}[/]", c.detail, c.hint)
    console = Console()
    console.print(table)
    verdict = "[green]BPF collectors can run on this host[/]" if can_run else "[red]BPF collectors cannot run here; see the hints above[/]"
    console.print(verdict)


def handle(args: argparse.Namespace, config: Config) -> int:
    checks = run_checks(config)
    can_run = collectors_can_run(checks)
    if args.json:
        print(json.dumps({"checks": [asdict(c) for c in checks], "collectors_can_run": can_run}, indent=2))
    else:
        _print_table(checks, can_run)
    return 0 if can_run else 1


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = sub.add_parser(
        "doctor",
        help="check what works on this host (BPF, tracepoints, headers, NVML, engines) and what to do about gaps",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    parser.add_argument("--json", action="store_true", help='print {"checks": [{"name","status","detail","hint"}]}')
    parser.set_defaults(handler=handle)


CheckFn = Callable[[], Check]

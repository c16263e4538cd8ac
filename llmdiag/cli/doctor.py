"""``llmdiag doctor``: what works on this host, and what to do about each gap.

Every check has a status (``ok``, ``degraded``, ``unavailable``), a detail
(what was found), a hint (what to do) and ``optional`` (an upgrade such as
kprobes, fentry, BTF or BPF run-time stats: nothing is lost without it).
``--json`` prints ``{"checks": [{"name", "status", "detail", "hint", "optional"}],
"collectors_can_run": bool}``. The exit code is 0 when the BPF collectors can
run (bpf(2), bcc, kernel headers, tracefs and the tcp collector's required
attach points all work) and 1 otherwise; engine, /proc and GPU collectors need
none of that. The attach points checked (``tracepoint:sock:inet_sock_set_state``,
``raw_tracepoint:...``, ``kprobe:...``, ``uprobe:libcuda.so:...``) are the ones the
collectors declare (:func:`llmdiag.collectors.attach_points.all_attach_points`),
and NVML is asked through :func:`llmdiag.collectors.nvml.probe_nvml`.
Run as a non-root user, the checks that need root say so instead of failing.
With ``--backend URL`` (or ``[[backends]]`` in the config) it also scrapes
each backend's ``/metrics`` once and names the engine that answers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from llmdiag.bpf import features
from llmdiag.collectors.attach_points import all_attach_points
from llmdiag.collectors.base import AttachNeed
from llmdiag.collectors.discovery import discover
from llmdiag.collectors.kube import PodMetadataReader
from llmdiag.collectors.nvml import probe_nvml
from llmdiag.config import Config

if TYPE_CHECKING:
    from rich.console import Console

OK, DEGRADED, UNAVAILABLE = "ok", "degraded", "unavailable"

#: Attach-point kinds that are upgrades or fallbacks when a collector does not require them.
_OPTIONAL_KINDS = {"raw_tracepoint", "kprobe"}
#: Upgrades over the tracepoint path: shown apart, never as gaps.
OPTIONAL = {"btf", "kprobe", "fentry", "bpf_stats"}

_NEEDS_ROOT_HINT = "run `sudo llmdiag doctor` to check it; the collectors need root or CAP_BPF + CAP_PERFMON"


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str
    hint: str = ""
    optional: bool = False


def _guarded(name: str, probe: Callable[[], Check | list[Check]]) -> list[Check]:
    """Run one probe; doctor reports what it cannot check, it never crashes.

    A non-root user cannot read tracefs (``/sys/kernel/tracing`` is 0700): that is
    the answer "needs root/CAP_BPF" for this check, with the way to get one."""
    try:
        result = probe()
    except PermissionError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        return [Check(name, UNAVAILABLE, f"needs root/CAP_BPF: permission denied{where}", _NEEDS_ROOT_HINT)]
    except Exception as exc:  # noqa: BLE001 - one odd probe must not hide the others
        return [Check(name, DEGRADED, f"could not check: {type(exc).__name__}: {exc}", "please report this with the output of uname -a")]
    return result if isinstance(result, list) else [result]


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


def _tracefs_denied(sys_root: str = "/sys") -> str | None:
    """The tracefs ``events`` directory this user may not read (tracefs is 0700 root), or None.

    The feature probes read a denied tracefs as "absent"; doctor must say "needs root"
    instead, or a non-root user is told the kernel lacks what it has."""
    for rel in ("kernel/tracing", "kernel/debug/tracing"):
        events = Path(sys_root) / rel / "events"
        try:
            events.is_dir()
        except PermissionError:
            return str(events)
    return None


def _needs_root(name: str, denied: str) -> Check:
    return Check(name, UNAVAILABLE, f"needs root/CAP_BPF: permission denied ({denied})", _NEEDS_ROOT_HINT)


def _tracefs() -> Check:
    denied = _tracefs_denied()
    if denied:
        return _needs_root("tracefs", denied)
    root, what = features.ensure_tracefs()
    return Check("tracefs", OK if root else UNAVAILABLE, what,
                 "" if root else "mount -t tracefs tracefs /sys/kernel/tracing (needs root)")


def _attach_check(need: AttachNeed) -> Check:
    """One attach point a collector declares, checked on this kernel."""
    name = f"{need.kind}:{need.target}"
    what = f"({need.collector}: {need.purpose or need.kind})"
    optional = not need.required and need.kind in _OPTIONAL_KINDS
    denied = _tracefs_denied()
    if denied and need.kind != "raw_tracepoint":  # these are looked up in tracefs
        return replace(_needs_root(name, denied), optional=optional)
    present = need.present()
    if present is None:  # a raw tracepoint needs bcc to probe it: the collector says at start-up
        return Check(name, DEGRADED, f"not probed here {what}",
                     "`llmdiag collect --once --json` shows in the collector's status what it attached", optional)
    if present:
        return Check(name, OK, f"present {what}", optional=optional)
    if need.required:
        return Check(name, UNAVAILABLE, f"missing {what}", f"the {need.collector} collector cannot run on this kernel")
    return Check(name, DEGRADED, f"missing {what}",
                 "not needed: a fallback or upgrade" if optional else "the signal it feeds will be missing on this kernel",
                 optional)


def _attach_points() -> list[Check]:
    """What the BPF collectors attach to, as each declares it (the collectors own the list)."""
    checks: list[Check] = []
    for need in all_attach_points():
        checks += _guarded(f"{need.kind}:{need.target}", lambda n=need: _attach_check(n))
    return checks


def _kprobes() -> Check:
    probe = features.kprobes_supported()
    denied = _tracefs_denied()
    if not probe and denied:  # no kprobe PMU, and kprobe_events could not be looked for
        return replace(_needs_root("kprobe", denied), optional=True)
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
    denied = _tracefs_denied()
    if not probe and denied:
        return _needs_root("uprobe", denied)
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
    probe = probe_nvml()  # collectors/nvml.py owns NVML: doctor never touches pynvml itself
    if not probe.ok:
        return Check("nvml", UNAVAILABLE, f"NVML could not start: {probe.reason}",
                     probe.hint or "GPU signals are skipped without NVML")
    if not probe.device_count:
        return Check("nvml", DEGRADED, f"driver {probe.driver_version}, no GPU", "NVML works but sees no GPU")
    return Check("nvml", OK, f"driver {probe.driver_version}, {probe.device_count} GPU(s)")


def _engines(config: Config) -> Check:
    configured = config.backend_list()
    try:
        result = discover()
    except Exception as exc:  # noqa: BLE001 - doctor reports, never crashes
        return Check("engines", DEGRADED, f"discovery failed: {exc}", "pass engines with --backend URL")
    found = result.backends
    kube = PodMetadataReader("/proc", os.environ.get("NODE_NAME"))

    def where(pid: int | None) -> str:
        if not pid:
            return ""
        try:
            labels = kube.labels(pid)
        except Exception:  # noqa: BLE001 - a label is a nicety in a report
            labels = {}
        pod = f", pod {labels['namespace']}/{labels['pod']}" if "pod" in labels and "namespace" in labels else ""
        return f" (pid {pid}{pod})"

    names = [f"{b.engine or '?'} at {b.url}{where(b.pid)}" for b in found]
    shown = names[:8] + ([f"and {len(names) - 8} more"] if len(names) > 8 else [])  # a readable line, not a page
    spaces = f" (this network namespace and {result.namespaces} other(s): pods, containers)" if result.namespaces else ""
    detail = f"{len(found)} engine(s) on local listening ports{spaces}"
    detail += f": {'; '.join(shown)}" if names else ""
    if configured:
        detail += f"; {len(configured)} configured"
    if result.unreadable_processes:
        detail += f"; {result.unreadable_processes} process(es) whose network namespace could not be read"
    # An engine bound to loopback inside its pod answers only inside the pod: worth a degraded check.
    stranded = [u for u in result.unreachable if u.likely_engine]
    if stranded:
        more = f" and {len(stranded) - 3} more" if len(stranded) > 3 else ""
        detail += f"; not reachable from the node: {'; '.join(u.describe() for u in stranded[:3])}{more}"
        return Check("engines", DEGRADED, detail,
                     "an engine bound to 127.0.0.1 in its own pod answers only inside the pod: start it on 0.0.0.0 "
                     "(vLLM/SGLang --host 0.0.0.0), or run llmdiag in that pod")
    if not found and not configured:
        return Check("engines", DEGRADED, detail,
                     "no vLLM/SGLang/TRT-LLM/Triton/TGI /metrics found; pass --backend URL or run llmdiag fake-engine")
    return Check("engines", OK, detail)


def _backends(config: Config) -> list[Check]:
    """Scrape each configured backend's /metrics once: does it answer, and as which engine?"""
    from llmdiag.collectors.engine import EngineCollector, scraped_at  # noqa: PLC0415 - only with backends

    backends = config.backend_list()
    if not backends:
        return []
    collector = EngineCollector(backends, config.engine)
    try:
        collector.collect(time.time())
    finally:
        collector.close()
    checks = []
    for backend in backends:
        scrape = collector.results.get(backend.name)
        name = f"backend:{backend.name}"
        where = scraped_at(backend, config.engine.metrics_path) or f"{backend.url}{config.engine.metrics_path}"
        if scrape is None or not scrape.up:
            error = scrape.error if scrape is not None else "not scraped"
            hint = ("is the engine running, and is this its HTTP port? "
                    "`llmdiag scrape URL` shows what it serves")
            if backend.scheme == "grpc":
                hint = ("a gRPC port rarely serves /metrics: set the backend's metrics_url to the engine's "
                        "HTTP metrics (Triton: port 8002), or add its HTTP port as an http:// backend too")
            checks.append(Check(name, UNAVAILABLE, f"{where}: {error}", hint))
        elif not scrape.engine:
            checks.append(Check(name, DEGRADED, f"{where} answers, but with no known engine metrics",
                                "is this an inference engine (vLLM, SGLang, TRT-LLM, Triton, TGI)? pass --engine to "
                                "`llmdiag scrape` if the scrape is ambiguous"))
        else:
            models = f", serving {', '.join(scrape.models)}" if scrape.models else ""
            problems = f"; {scrape.problems[0]}" if scrape.problems else ""
            checks.append(Check(name, DEGRADED if problems else OK,
                                f"{where}: {scrape.engine}, {len(scrape.signals)} signals{models}{problems}",
                                "see `llmdiag scrape URL` for the details" if problems else ""))
    return checks


def run_checks(config: Config) -> list[Check]:
    probes: list[tuple[str, Callable[[], Check | list[Check]]]] = [
        ("kernel", _kernel),
        ("privileges", _root),
        ("bpf_syscall", _bpf_syscall),
        ("btf", _btf),
        ("tracefs", _tracefs),
        ("attach_points", _attach_points),
        ("kprobe", _kprobes),
        ("uprobe", _uprobes),
        ("kernel_headers", _headers),
        ("bcc", _bcc),
    ]
    checks: list[Check] = []
    for name, probe in probes:
        checks += _guarded(name, probe)
    bcc_ok = checks[-1].status == OK
    checks += _guarded("fentry", lambda: _fentry(bcc_ok))
    checks += _guarded("bpf_stats", _bpf_stats)
    checks += _guarded("nvml", _nvml)
    checks += _guarded("engines", lambda: _engines(config))
    checks += _guarded("backends", lambda: _backends(config))
    return [replace(c, optional=True) if c.name in OPTIONAL else c for c in checks]


def collectors_can_run(checks: list[Check]) -> bool:
    by_name = {c.name: c for c in checks}
    # The tcp collector is the base of the BPF signals: its required attach points decide.
    core = [f"{n.kind}:{n.target}" for n in all_attach_points() if n.collector == "tcp" and n.required]
    needed = ["bpf_syscall", "tracefs", "bcc", "kernel_headers", *core]
    return all(n in by_name and by_name[n].status != UNAVAILABLE for n in needed)


def _is_attach_point(check: Check) -> bool:
    kind, _, target = check.name.partition(":")
    return bool(target) and kind in {"tracepoint", "raw_tracepoint", "kprobe", "uprobe"}


#: Sections of the text report: (title, does this check belong here).
_SECTIONS: tuple[tuple[str, Callable[[Check], bool]], ...] = (
    ("Needed by the BPF collectors (tcp, timewait, http2, cuda)",
     lambda c: not c.optional and not _is_attach_point(c) and not c.name.startswith(("nvml", "engines", "backend:"))),
    ("Attach points (as the collectors declare them)", _is_attach_point),
    ("Optional upgrades (nothing is lost without them)", lambda c: c.optional and not _is_attach_point(c)),
    ("GPU and engines", lambda c: c.name.startswith(("nvml", "engines", "backend:"))),
)
_MARKS = {OK: ("ok", "green"), DEGRADED: ("!!", "yellow"), UNAVAILABLE: ("no", "red")}


def _fold_attach_points(rows: list[Check]) -> list[Check]:
    """The present attach points as one line, and the ones that could not be checked (no
    root) as one line; only the missing or unprobed ones keep a line each."""
    present = [c for c in rows if c.status == OK and c.detail.startswith("present")]
    unchecked = [c for c in rows if c.detail.startswith("needs root")]
    missing = [c for c in rows if c not in present and c not in unchecked]
    folded = []
    if present:
        users = list(dict.fromkeys(c.detail.split("(", 1)[-1].split(":", 1)[0] for c in present))  # in declared order
        everything = "all " if len(present) == len(rows) else ""
        folded.append(Check("attach points", OK, f"{everything}{len(present)} present (used by {', '.join(users)})"))
    if unchecked:
        folded.append(replace(unchecked[0], name=f"attach points ({len(unchecked)})"))
    return folded + missing


def _print_report(checks: list[Check], can_run: bool, console: Console | None = None) -> None:
    """One line per check and an indented hint: readable at 80 columns, where a four-column
    table is not. Attach points that are present fold into one line. Every string from a
    probe goes in as Text, never as markup: "[[backends]]" or "[Errno 13]" must print as is."""
    from rich.console import Console  # noqa: PLC0415
    from rich.padding import Padding  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415
    from rich.text import Text  # noqa: PLC0415

    console = console or Console(highlight=False)
    console.print(Text("llmdiag doctor", style="bold"))
    for title, belongs in _SECTIONS:
        rows = [c for c in checks if belongs(c)]
        if not rows:
            continue
        console.print()
        console.print(Text(title, style="bold underline"))
        if title.startswith("Attach points"):
            rows = _fold_attach_points(rows)
        grid = Table.grid(padding=(0, 1))
        grid.add_column(width=2, no_wrap=True)
        grid.add_column(overflow="fold")  # wrapped lines keep the indent of the text, not the mark
        for c in rows:
            mark, colour = _MARKS[c.status]
            if c.optional and c.status != OK:
                mark, colour = "--", "dim"  # an upgrade this kernel lacks, not a gap
            body = Text()
            body.append(c.name, style="bold")
            body.append(f"  {c.detail}")
            if c.hint:
                body.append(f"\n-> {c.hint}", style="italic")
            grid.add_row(Text(mark, style=f"bold {colour}"), body)
        console.print(Padding(grid, (0, 0, 0, 1)))
    console.print()
    if can_run:
        console.print(Text("BPF collectors can run on this host.", style="green"))
    else:
        console.print(Text("BPF collectors cannot run here; see the hints above. "
                           "The engine, /proc and GPU collectors need none of this.", style="red"))


def handle(args: argparse.Namespace, config: Config) -> int:
    checks = run_checks(config)
    can_run = collectors_can_run(checks)
    if args.json:
        print(json.dumps({"checks": [asdict(c) for c in checks], "collectors_can_run": can_run}, indent=2))
    else:
        _print_report(checks, can_run)
    return 0 if can_run else 1


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = sub.add_parser(
        "doctor",
        help="check what works on this host (BPF, tracepoints, headers, NVML, engines) and what to do about gaps",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
        epilog="Add --backend URL (repeatable) to check that each backend answers /metrics.",
    )
    parser.add_argument("--json", action="store_true",
                        help='print {"checks": [{"name","status","detail","hint","optional"}], "collectors_can_run"}')
    parser.set_defaults(handler=handle)


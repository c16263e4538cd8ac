"""Feature probes: what this kernel lets BPF collectors attach to.

The collectors are tracepoint-first (SPEC section 2): kprobes are compiled out
on some kernels (Firecracker guests) and fentry attach can fail with EPERM
even where ``BPF.support_kfunc()`` says yes, so the probes here look at what
the kernel actually exposes, and :func:`fentry_supported` really tries an
attach. ``sys_root`` and ``proc_root`` are injectable for tests.

bcc is imported lazily, only by the probes that need it.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import platform
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "Probe",
    "bcc_available",
    "bpf_stats_enabled",
    "bpf_syscall_available",
    "btf_available",
    "capabilities",
    "captured_stderr",
    "ensure_tracefs",
    "fentry_supported",
    "kernel_headers",
    "kprobes_supported",
    "tracefs_root",
    "tracepoint_exists",
    "uprobes_supported",
]


@dataclass(frozen=True)
class Probe:
    """Result of one feature probe: ``ok`` plus a human-readable detail."""

    ok: bool
    detail: str

    def __bool__(self) -> bool:
        return self.ok


_TRACEFS_CANDIDATES = ("kernel/tracing", "kernel/debug/tracing")


def tracefs_root(sys_root: str | Path = "/sys") -> Path | None:
    """The mounted tracefs (``events/`` present), or ``None``."""
    for rel in _TRACEFS_CANDIDATES:
        path = Path(sys_root) / rel
        try:
            if (path / "events").is_dir():
                return path
        except PermissionError:
            # tracefs is mode 0700 root: a non-root user cannot even look. check_environment()
            # then says "not root" with the way out, instead of a bare PermissionError.
            continue
    return None


def ensure_tracefs(sys_root: str | Path = "/sys") -> tuple[Path | None, str]:
    """Mount tracefs at ``/sys/kernel/tracing`` if it is not mounted.

    Returns the tracefs path (or ``None``) and what was done, so callers can
    say it: this changes the host, and SPEC section 2 asks that it never
    happen silently.
    """
    root = tracefs_root(sys_root)
    if root is not None:
        return root, f"tracefs mounted at {root}"
    target = Path(sys_root) / "kernel/tracing"
    if not target.is_dir():
        return None, f"{target} does not exist (kernel without tracefs?)"
    if os.geteuid() != 0:
        return None, f"tracefs is not mounted at {target} and mounting it needs root"
    proc = subprocess.run(
        ["mount", "-t", "tracefs", "tracefs", str(target)], capture_output=True, text=True, timeout=10
    )
    if proc.returncode != 0:
        return None, f"mount -t tracefs failed: {proc.stderr.strip() or proc.returncode}"
    root = tracefs_root(sys_root)
    if root is None:
        return None, f"mounted tracefs at {target} but it has no events/ directory"
    return root, f"tracefs was not mounted: mounted it at {target}"


def tracepoint_exists(category: str, event: str, sys_root: str | Path = "/sys") -> bool:
    """True when ``category:event`` is a tracepoint of the running kernel."""
    root = tracefs_root(sys_root)
    return root is not None and (root / "events" / category / event).is_dir()


def _event_source(kind: str, sys_root: str | Path) -> bool:
    return (Path(sys_root) / "bus/event_source/devices" / kind).is_dir()


def kprobes_supported(sys_root: str | Path = "/sys") -> Probe:
    """kprobes need ``CONFIG_KPROBES``: the ``kprobe`` PMU or ``kprobe_events`` in tracefs."""
    root = tracefs_root(sys_root)
    if _event_source("kprobe", sys_root) or (root is not None and (root / "kprobe_events").exists()):
        return Probe(True, "kprobe PMU present")
    return Probe(False, "kernel built without kprobes (no kprobe PMU, no kprobe_events)")


def uprobes_supported(sys_root: str | Path = "/sys") -> Probe:
    root = tracefs_root(sys_root)
    if _event_source("uprobe", sys_root) or (root is not None and (root / "uprobe_events").exists()):
        return Probe(True, "uprobe PMU present")
    return Probe(False, "kernel built without uprobes (no uprobe PMU, no uprobe_events)")


def btf_available(sys_root: str | Path = "/sys") -> Probe:
    path = Path(sys_root) / "kernel/btf/vmlinux"
    if path.is_file():
        return Probe(True, f"{path} ({path.stat().st_size // 1024} KiB)")
    return Probe(False, f"{path} missing (kernel without CONFIG_DEBUG_INFO_BTF)")


# bpf(2) syscall numbers; the BPF_MAP_CREATE probe creates and closes one tiny array map.
_NR_BPF = {"x86_64": 321, "aarch64": 280, "ppc64le": 361, "s390x": 351, "riscv64": 280}


def bpf_syscall_available() -> Probe:
    """Create (and close) a one-entry BPF array map with the raw bpf(2) syscall."""
    nr = _NR_BPF.get(platform.machine())
    if nr is None:
        return Probe(False, f"unknown bpf(2) syscall number on {platform.machine()}")
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)

    class MapCreateAttr(ctypes.Structure):
        _fields_ = [
            ("map_type", ctypes.c_uint32),
            ("key_size", ctypes.c_uint32),
            ("value_size", ctypes.c_uint32),
            ("max_entries", ctypes.c_uint32),
            ("map_flags", ctypes.c_uint32),
        ]

    attr = MapCreateAttr(2, 4, 8, 1, 0)  # BPF_MAP_TYPE_ARRAY, u32 -> u64, 1 entry
    fd = libc.syscall(nr, 0, ctypes.byref(attr), ctypes.sizeof(attr))  # BPF_MAP_CREATE = 0
    if fd < 0:
        err = ctypes.get_errno()
        return Probe(False, f"bpf(BPF_MAP_CREATE) failed: {os.strerror(err)}")
    os.close(fd)
    return Probe(True, "bpf(2) works (created and closed a test map)")


def bcc_available() -> Probe:
    try:
        import bcc  # noqa: PLC0415 - lazy on purpose: bcc is a distro module
    except ImportError as exc:
        return Probe(False, f"cannot import bcc ({exc}); install python3-bpfcc and use a --system-site-packages venv")
    version = getattr(bcc, "__version__", "unknown version")
    return Probe(True, f"bcc {version}")


def kernel_headers(release: str | None = None, modules_root: str | Path = "/lib/modules") -> Probe:
    """Headers for bcc at ``/lib/modules/$(uname -r)/build``; says when they are a fallback."""
    release = release or os.uname().release
    build = Path(modules_root) / release / "build"
    if not build.exists():
        if Path("/sys/kernel/kheaders.tar.xz").exists():
            return Probe(True, "in-kernel headers (CONFIG_IKHEADERS)")
        return Probe(False, f"{build} missing")
    target = build.resolve()
    if release not in target.name:
        return Probe(True, f"fallback: {build} -> {target} (not the running kernel's headers; tracepoint programs only)")
    return Probe(True, f"{build} -> {target}")


def bpf_stats_enabled(proc_root: str | Path = "/proc") -> Probe:
    path = Path(proc_root) / "sys/kernel/bpf_stats_enabled"
    try:
        value = path.read_text().strip()
    except OSError:
        return Probe(False, f"{path} missing")
    return Probe(value == "1", f"kernel.bpf_stats_enabled = {value}")


_CAPS = {"CAP_NET_ADMIN": 12, "CAP_SYS_PTRACE": 19, "CAP_SYS_ADMIN": 21, "CAP_SYS_RESOURCE": 24,
         "CAP_PERFMON": 38, "CAP_BPF": 39}


def capabilities(proc_root: str | Path = "/proc", pid: str = "self") -> dict[str, bool]:
    """Effective capabilities that the collectors care about, from ``/proc/PID/status``."""
    cap_eff = 0
    try:
        for line in (Path(proc_root) / pid / "status").read_text().splitlines():
            if line.startswith("CapEff:"):
                cap_eff = int(line.split()[1], 16)
    except (OSError, ValueError, IndexError):
        pass
    return {name: bool(cap_eff >> bit & 1) for name, bit in _CAPS.items()}


class Captured:
    text = ""


# fd 2 is process-wide: one capture at a time.
_CAPTURE_LOCK = threading.Lock()


@contextlib.contextmanager
def captured_stderr() -> Iterator[Captured]:
    """Capture what C libraries (bcc, LLVM, libbpf) write to fd 2: compile and verifier errors.

    Used by the probes here and by :mod:`llmdiag.bpf.loader` to put the real error into a reason.

    LLVM does not always return an error: on some (a BPF stack over 512 bytes, any
    error diagnostic) it calls ``exit(1)`` in the middle of the capture, and the
    process would die with its only explanation in a temporary file. While the
    capture is open, :class:`_ExitGuard` has the C library's exit path copy the
    captured text to the real stderr first (glibc only; elsewhere there is no guard)."""
    captured = Captured()
    with _CAPTURE_LOCK, tempfile.TemporaryFile(mode="w+b") as tmp:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        guard = _ExitGuard.arm(tmp.fileno(), saved)
        try:
            yield captured
        finally:
            if guard is not None:
                guard.disarm()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            captured.text = tmp.read().decode(errors="replace")


class _ExitGuard:
    """A C-level exit handler that lives exactly as long as one capture.

    Python's :mod:`atexit` does not run when a C library calls ``exit()``, but
    handlers registered with ``__cxa_atexit`` do. The handler is registered under
    a private "DSO handle" so that ``__cxa_finalize(handle)`` can remove it again
    when the capture ends (it calls it once then, disarmed: a no-op); a handler
    left registered would run after the interpreter is finalized and crash it.
    musl's ``__cxa_finalize`` removes nothing, hence glibc only."""

    _EXIT_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
    _libc: ctypes.CDLL | None = None
    _usable: bool | None = None

    def __init__(self, captured_fd: int, stderr_fd: int) -> None:
        self.captured_fd = captured_fd
        self.stderr_fd = stderr_fd
        self.armed = True
        self.handle = ctypes.c_char()  # its address is the private DSO handle
        self.callback = self._EXIT_FN(self._on_exit)  # referenced here so ctypes keeps it alive

    @classmethod
    def arm(cls, captured_fd: int, stderr_fd: int) -> _ExitGuard | None:
        libc = cls._glibc()
        if libc is None:
            return None
        guard = cls(captured_fd, stderr_fd)
        if getattr(libc, "__cxa_atexit")(guard.callback, None, ctypes.byref(guard.handle)) != 0:
            return None
        return guard

    @classmethod
    def _glibc(cls) -> ctypes.CDLL | None:
        if cls._usable is None:
            cls._usable = False
            if platform.libc_ver()[0] == "glibc":
                try:
                    libc = ctypes.CDLL(None)
                    # getattr: a literal ``libc.__cxa_atexit`` in a class body is name-mangled.
                    getattr(libc, "__cxa_atexit").argtypes = [cls._EXIT_FN, ctypes.c_void_p, ctypes.c_void_p]
                    getattr(libc, "__cxa_finalize").argtypes = [ctypes.c_void_p]
                except (OSError, AttributeError):
                    pass
                else:
                    cls._libc, cls._usable = libc, True
        return cls._libc if cls._usable else None

    def disarm(self) -> None:
        self.armed = False
        libc = self._glibc()
        if libc is not None:
            getattr(libc, "__cxa_finalize")(ctypes.byref(self.handle))

    def _on_exit(self, _arg: int | None) -> None:
        if not self.armed:
            return
        self.armed = False
        try:
            text = _read_all(self.captured_fd)
            message = (b"llmdiag: the process exited while compiling/loading a BPF program; "
                       b"the compiler said:\n" + text + (b"" if text.endswith(b"\n") else b"\n"))
            os.dup2(self.stderr_fd, 2)  # whatever else is written on the way out goes to stderr too
            view = memoryview(message)
            while view:
                view = view[os.write(2, view):]
        except OSError:
            pass


def _read_all(fd: int) -> bytes:
    chunks, offset = [], 0
    while chunk := os.pread(fd, 1 << 16, offset):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


_FENTRY_PROBE = "KFUNC_PROBE(tcp_sendmsg) { return 0; }"


def fentry_supported() -> Probe:
    """Really try to load and attach an fentry program; EPERM on some kernels despite BTF."""
    try:
        from bcc import BPF  # noqa: PLC0415
    except ImportError as exc:
        return Probe(False, f"bcc not importable: {exc}")
    try:
        if not BPF.support_kfunc():
            return Probe(False, "kernel has no fentry/kfunc support")
    except Exception as exc:  # noqa: BLE001 - bcc raises plain Exception
        return Probe(False, f"support_kfunc() failed: {exc}")
    with captured_stderr() as captured:
        try:
            prog = BPF(text=_FENTRY_PROBE)
        except Exception as exc:  # noqa: BLE001
            prog = None
            error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if prog is None:
        # bcc's own message for EPERM is "Need super-user privileges" even as root;
        # libbpf's line on stderr says what really failed.
        kernel_says = " ".join(line.strip() for line in captured.text.splitlines() if "Failed to" in line)
        return Probe(False, f"fentry attach failed: {kernel_says or error}")
    try:
        prog.cleanup()
    except Exception:  # noqa: BLE001
        pass
    return Probe(True, "fentry attach works")

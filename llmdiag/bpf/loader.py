"""The one bcc loader every BPF collector uses.

A program is a real C file next to this module, ``llmdiag/bpf/<name>.bpf.c``,
with its structs and enums in ``<name>.h`` (and :file:`common.h` for the
error counters). Options reach it as ``-DNAME=value`` compiler flags, never by
editing the source text::

    prog = Program.load("tcp_health", defines={"MAX_SOCKS": 65536})
    prog.attach_tracepoint("sock:sock_send_length", "on_send_length")
    counters = prog.read_hash("stats")       # cumulative; the collector takes deltas
    prog.close()                              # idempotent; also runs at exit

:func:`render` gives the text the compiler is handed (defines, then the source
with local headers inlined) without bcc, root or a kernel, so a program can be
reviewed and unit-tested anywhere.

Reading maps: :meth:`Program.read_hash` is a *cumulative* read by default.
Counters in llmdiag maps only grow; collectors keep the previous reading and
report ``_total`` values or deltas. Read-and-clear (``clear=True``) is there
for gauges that a program rebuilds every tick; it races with concurrent
increments between the read and the delete, which is why counters never use it.

Failures: anything that keeps a program from running (no bcc, not root, no
headers, no tracefs, compile or load error, attach error) raises
:class:`BPFUnavailable` with a ``reason`` and a ``hint`` that a collector puts
into its ``unavailable`` status.

bcc is imported inside functions only: ``import llmdiag.bpf.loader`` works on a
machine without bcc.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmdiag.bpf import features

__all__ = [
    "BPF_DIR",
    "AttachPoint",
    "BPFUnavailable",
    "Program",
    "check_environment",
    "cflags",
    "render",
    "source_path",
]

log = logging.getLogger("llmdiag.bpf")

BPF_DIR = Path(__file__).resolve().parent

#: Index of the map-full counter in ``llmdiag_errors`` (common.h).
ERR_MAP_FULL = 0
ERR_READ = 1

_DEFINE_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")
_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')


class BPFUnavailable(RuntimeError):
    """A BPF program cannot run here. ``reason`` says why, ``hint`` what to do."""

    def __init__(self, reason: str, hint: str = "") -> None:
        super().__init__(f"{reason}" + (f" (hint: {hint})" if hint else ""))
        self.reason = reason
        self.hint = hint


# -- sources and defines --------------------------------------------------------


def source_path(name: str) -> Path:
    """``llmdiag/bpf/<name>.bpf.c``; raises :class:`BPFUnavailable` if it is not shipped."""
    if not re.fullmatch(r"[a-z0-9_]+", name):
        raise ValueError(f"bad BPF program name {name!r}")
    path = BPF_DIR / f"{name}.bpf.c"
    if not path.is_file():
        raise BPFUnavailable(f"BPF program {path} is missing", "reinstall llmdiag (package data *.bpf.c)")
    return path


def _define_value(name: str, value: object) -> str:
    if not _DEFINE_NAME.match(name):
        raise ValueError(f"define name {name!r} must be UPPER_SNAKE_CASE")
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    text = str(value)
    # Only plain tokens: a define is an option, not a way to inject code.
    if not re.fullmatch(r"[A-Za-z0-9_.+-]+", text):
        raise ValueError(f"define {name}={text!r}: only numbers and identifiers are allowed")
    return text


def cflags(defines: Mapping[str, object] | None = None) -> list[str]:
    """The compiler flags for a program: ``-I`` this directory plus one ``-DNAME=value`` per define."""
    flags = [f"-I{BPF_DIR}"]
    for name, value in sorted((defines or {}).items()):
        flags.append(f"-D{name}={_define_value(name, value)}")
    return flags


def _inline_local_includes(path: Path, seen: set[Path]) -> list[str]:
    lines: list[str] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        match = _LOCAL_INCLUDE.match(line)
        if match:
            header = (path.parent / match.group(1)).resolve()
            if header.parent == BPF_DIR and header.is_file():
                if header not in seen:
                    seen.add(header)
                    lines.append(f"/* ---- begin {header.name} ---- */")
                    lines.extend(_inline_local_includes(header, seen))
                    lines.append(f"/* ---- end {header.name} ---- */")
                continue
        lines.append(line)
    return lines


def render(name: str, defines: Mapping[str, object] | None = None) -> str:
    """The program as the compiler gets it: a ``#define`` per option, then the
    source with llmdiag's own headers inlined (bcc's and the kernel's headers
    stay as ``#include`` lines). Needs neither bcc nor root."""
    path = source_path(name)
    out = [f"/* llmdiag BPF program {name}: {path} */", f"/* cflags: {' '.join(cflags(defines))} */"]
    for flag in cflags(defines)[1:]:
        key, _, value = flag[2:].partition("=")
        out.append(f"#define {key} {value}")
    out.extend(_inline_local_includes(path, set()))
    return "\n".join(out) + "\n"


# -- environment ----------------------------------------------------------------


def check_environment() -> None:
    """Raise :class:`BPFUnavailable` unless bcc, root, kernel headers and tracefs are all there."""
    bcc = features.bcc_available()
    if not bcc:
        raise BPFUnavailable(bcc.detail, "apt-get install python3-bpfcc; run from a --system-site-packages venv")
    if os.geteuid() != 0:
        caps = features.capabilities()
        if not (caps.get("CAP_BPF") and caps.get("CAP_PERFMON")) and not caps.get("CAP_SYS_ADMIN"):
            raise BPFUnavailable("not root (and no CAP_BPF+CAP_PERFMON)", "run as root or grant CAP_BPF, CAP_PERFMON")
    headers = features.kernel_headers()
    if not headers:
        raise BPFUnavailable(f"no kernel headers for bcc: {headers.detail}", "run scripts/setup.sh (installs/links headers)")
    root, what = features.ensure_tracefs()
    if root is None:
        raise BPFUnavailable(f"tracefs unavailable: {what}", "mount -t tracefs tracefs /sys/kernel/tracing")


def _first_error_lines(text: str, limit: int = 6) -> str:
    keep = [ln.strip() for ln in text.splitlines() if "error" in ln.lower() or "failed" in ln.lower()]
    return " | ".join(keep[:limit]) or " | ".join(text.strip().splitlines()[-limit:])


# -- attach points --------------------------------------------------------------


@dataclass(frozen=True)
class AttachPoint:
    """One way to attach a function: ``kind`` is ``tracepoint`` (target ``cat:event``),
    ``kprobe``/``kretprobe`` (target a kernel function) or ``fentry``."""

    kind: str
    target: str
    fn_name: str

    def available(self) -> bool:
        if self.kind == "tracepoint":
            category, _, event = self.target.partition(":")
            return features.tracepoint_exists(category, event)
        if self.kind in ("kprobe", "kretprobe"):
            return bool(features.kprobes_supported())
        if self.kind == "fentry":
            return bool(features.fentry_supported())
        return False

    def describe(self) -> str:
        return f"{self.kind}:{self.target}"


def choose(candidates: Sequence[AttachPoint]) -> AttachPoint | None:
    """The first candidate this kernel offers (tracepoints are listed first by convention)."""
    for point in candidates:
        if point.available():
            return point
    return None


# -- the loaded program -----------------------------------------------------------


class Program:
    """A compiled, loaded BPF program and its attachments. Not thread-safe except :meth:`close`."""

    def __init__(self, name: str, bpf: Any, defines: Mapping[str, object]) -> None:
        self.name = name
        self.bpf = bpf
        self.defines = dict(defines)
        self.attached: list[str] = []
        self.lost_events_total = 0
        self._closed = False
        self._close_lock = threading.Lock()
        atexit.register(self.close)

    @classmethod
    def load(cls, name: str, defines: Mapping[str, object] | None = None, *, check: bool = True) -> Program:
        """Compile and load ``<name>.bpf.c``; ``TRACEPOINT_PROBE`` functions attach themselves (bcc)."""
        defines = dict(defines or {})
        path = source_path(name)
        flags = cflags(defines)  # validates the defines before anything else
        if check:
            check_environment()
        from bcc import BPF  # noqa: PLC0415 - lazy: bcc is optional

        with features.captured_stderr() as captured:
            try:
                bpf = BPF(src_file=str(path).encode(), cflags=flags)
            except Exception as exc:  # noqa: BLE001 - bcc raises bare Exception for compile/load
                error: Exception | None = exc
            else:
                error = None
        if error is not None:
            detail = _first_error_lines(captured.text)
            raise BPFUnavailable(
                f"compiling/loading {path.name} failed: {error}" + (f": {detail}" if detail else ""),
                "check `llmdiag doctor`; kernel headers must match closely enough for the structs used",
            ) from error
        prog = cls(name, bpf, defines)
        prog.attached.extend(f"tracepoint:{tp}" for tp in _autoloaded_tracepoints(bpf))
        return prog

    # -- attaching ------------------------------------------------------------
    def _attach(self, what: str, fn: Callable[[], Any]) -> None:
        with features.captured_stderr() as captured:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001
                error: Exception | None = exc
            else:
                error = None
        if error is not None:
            detail = _first_error_lines(captured.text)
            raise BPFUnavailable(f"attaching {what} failed: {error}" + (f": {detail}" if detail else ""),
                                 "see `llmdiag doctor` for which attach types this kernel allows")
        self.attached.append(what)

    def attach_tracepoint(self, tracepoint: str, fn_name: str) -> None:
        """``tracepoint`` is ``category:event``."""
        self._attach(f"tracepoint:{tracepoint}", lambda: self.bpf.attach_tracepoint(tp=tracepoint.encode(), fn_name=fn_name.encode()))

    def attach_kprobe(self, event: str, fn_name: str) -> None:
        self._attach(f"kprobe:{event}", lambda: self.bpf.attach_kprobe(event=event.encode(), fn_name=fn_name.encode()))

    def attach_kretprobe(self, event: str, fn_name: str) -> None:
        self._attach(f"kretprobe:{event}", lambda: self.bpf.attach_kretprobe(event=event.encode(), fn_name=fn_name.encode()))

    def attach_uprobe(self, library: str, symbol: str, fn_name: str, pid: int = -1) -> None:
        self._attach(f"uprobe:{library}:{symbol}",
                     lambda: self.bpf.attach_uprobe(name=library.encode(), sym=symbol.encode(), fn_name=fn_name.encode(), pid=pid))

    def attach_uretprobe(self, library: str, symbol: str, fn_name: str, pid: int = -1) -> None:
        self._attach(f"uretprobe:{library}:{symbol}",
                     lambda: self.bpf.attach_uretprobe(name=library.encode(), sym=symbol.encode(), fn_name=fn_name.encode(), pid=pid))

    def attach(self, point: AttachPoint) -> None:
        if point.kind == "tracepoint":
            self.attach_tracepoint(point.target, point.fn_name)
        elif point.kind == "kprobe":
            self.attach_kprobe(point.target, point.fn_name)
        elif point.kind == "kretprobe":
            self.attach_kretprobe(point.target, point.fn_name)
        elif point.kind == "fentry":
            # fentry programs are KFUNC_PROBE()s: bcc attaches them at load time.
            self.attached.append(point.describe())
        else:
            raise ValueError(f"unknown attach kind {point.kind!r}")

    # -- maps -----------------------------------------------------------------
    def table(self, name: str) -> Any:
        return self.bpf.get_table(name.encode())

    def read_hash(self, name: str, clear: bool = False) -> list[tuple[Any, Any]]:
        """All entries of a hash map as ``(key, value)`` pairs of plain Python data
        (see :func:`plain`). Cumulative by default; ``clear=True`` deletes what was read."""
        table = self.bpf.get_table(name.encode())
        raw = list(table.items())
        if clear:
            for key, _ in raw:
                with contextlib.suppress(KeyError):
                    del table[key]
        return [(plain(k), plain(v)) for k, v in raw]

    def read_array(self, name: str) -> list[int]:
        """An array of integers as a list (per-CPU arrays are summed over CPUs)."""
        table = self.bpf.get_table(name.encode())
        out: list[int] = []
        for i in range(len(table)):
            value = table[table.Key(i)]
            if isinstance(value, (list, tuple)) or hasattr(value, "__len__") and not hasattr(value, "value"):
                out.append(int(sum(int(getattr(v, "value", v)) for v in value)))
            else:
                out.append(int(getattr(value, "value", value)))
        return out

    def errors(self) -> dict[str, int]:
        """``map_full`` and ``read`` failure counts from ``llmdiag_errors`` (common.h), plus lost events."""
        counts = {"lost_events": self.lost_events_total}
        if self._closed:
            return counts
        try:
            errors = self.read_array("llmdiag_errors")
        except KeyError:
            return counts
        counts["map_full"] = errors[ERR_MAP_FULL]
        counts["read"] = errors[ERR_READ]
        return counts

    # -- event buffers ------------------------------------------------------------
    def _lost(self, count: int) -> None:
        self.lost_events_total += int(count)

    def open_perf_buffer(self, name: str, callback: Callable[[int, Any, int], None], page_cnt: int = 64) -> None:
        """Perf buffer for rare events; lost samples are counted in :attr:`lost_events_total`."""
        self.bpf[name.encode()].open_perf_buffer(callback, page_cnt=page_cnt, lost_cb=self._lost)

    def open_ring_buffer(self, name: str, callback: Callable[[Any, Any, int], Any]) -> None:
        """Ring buffer for rare events. A ring buffer reports no losses to user space:
        programs count failed ``ringbuf_output`` calls themselves (``llmdiag_errors``)."""
        self.bpf[name.encode()].open_ring_buffer(callback)

    def poll(self, timeout_ms: int = 0) -> None:
        """Drain perf and ring buffers (non-blocking with the default timeout)."""
        if self.bpf.perf_buffers:
            self.bpf.perf_buffer_poll(timeout=timeout_ms)
        if getattr(self.bpf, "_ringbuf_manager", None):
            self.bpf.ring_buffer_consume()

    # -- teardown -------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Detach everything and free the program. Safe to call twice, from atexit or a signal handler."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
        try:
            self.bpf.cleanup()
        except Exception as exc:  # noqa: BLE001 - never let teardown raise
            log.warning("BPF program %s did not detach cleanly: %s", self.name, exc)
        self.attached.clear()

    def __enter__(self) -> Program:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def plain(value: Any) -> Any:
    """ctypes data from a bcc table as Python data: integers stay integers, a
    struct becomes a dict of its fields, a byte array ``bytes``, other arrays lists."""
    import ctypes  # noqa: PLC0415 - only needed with bcc

    if isinstance(value, ctypes.Structure | ctypes.Union):
        return {name: plain(getattr(value, name)) for name, *_ in value._fields_}
    if isinstance(value, ctypes.Array):
        if value._type_ in (ctypes.c_ubyte, ctypes.c_byte, ctypes.c_char):
            return bytes(value)
        return [plain(v) for v in value]
    if hasattr(value, "value"):
        return value.value
    return value


def _autoloaded_tracepoints(bpf: Any) -> list[str]:
    # bcc attaches every tracepoint__<cat>__<event> function itself (TRACEPOINT_PROBE).
    names = []
    for tp in getattr(bpf, "tracepoint_fds", {}) or {}:
        names.append(tp.decode() if isinstance(tp, bytes) else str(tp))
    return sorted(names)

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

Everything a collector does with its program goes through :class:`Program`;
no collector touches ``Program.bpf`` or ``bcc.libbcc``:

* attaching: ``attach_tracepoint``/``attach_kprobe``/``attach_kretprobe``/
  ``attach_uprobe``/``attach_uretprobe`` (or :meth:`Program.attach` with an
  :class:`AttachPoint`); :meth:`Program.detach_uprobes` removes one process's
  uprobes without resolving symbols again (works after the process exited);
* tail calls: :meth:`Program.load_function` loads a function without
  attaching it and returns its fd, :meth:`Program.set_prog_array` puts an fd
  into a ``BPF_PROG_ARRAY``;
* maps: :meth:`Program.read_hash`, :meth:`Program.read_array`,
  :meth:`Program.update_map` (``exist="noexist"`` is an insert that never
  overwrites what the program wrote meanwhile) and :meth:`Program.table`, the
  bcc table itself, for its ``Key``/``Leaf`` types, iteration and deletes;
* counters: :meth:`Program.errors` reads every slot of ``llmdiag_errors``,
  named by :data:`ERROR_NAMES` plus what :meth:`Program.name_errors` adds for
  a program's own slots; lost perf events are counted too.

Reading maps: :meth:`Program.read_hash` is a *cumulative* read by default. Whole
maps are read with batch lookups where the kernel has them (:mod:`llmdiag.bpf.maps`).
Counters in llmdiag maps only grow; collectors keep the previous reading and
report ``_total`` values or deltas. Read-and-clear (``clear=True``) is there
for gauges that a program rebuilds every tick; it races with concurrent
increments between the read and the delete, which is why counters never use it.

Failures: anything that keeps a program from running (no bcc, not root, no
headers, no tracefs, compile or load error, attach error) raises
:class:`BPFUnavailable` with a ``reason`` and a ``hint`` that a collector puts
into its ``unavailable`` status. The reason quotes what bcc, LLVM or the
verifier wrote to fd 2, which is captured while they run
(:func:`llmdiag.bpf.features.captured_stderr`). LLVM sometimes does not return
an error but calls ``exit(1)`` (a BPF stack over 512 bytes, any error
diagnostic); the capture then writes what the compiler said to the real stderr
on the way out, so the process never dies without a word.

bcc is imported inside functions only: ``import llmdiag.bpf.loader`` works on a
machine without bcc.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import logging
import os
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmdiag.bpf import features
from llmdiag.bpf.maps import BatchReader, converter, lookup_all

__all__ = [
    "BPF_DIR",
    "ERROR_NAMES",
    "PROG_TYPES",
    "UPDATE_FLAGS",
    "AttachPoint",
    "BPFUnavailable",
    "Program",
    "check_environment",
    "cflags",
    "program_tracepoints",
    "render",
    "source_path",
]

log = logging.getLogger("llmdiag.bpf")

BPF_DIR = Path(__file__).resolve().parent

#: Slots of ``llmdiag_errors`` that every program shares (``enum llmdiag_error`` in common.h).
ERR_MAP_FULL = 0
ERR_READ = 1
#: Names :meth:`Program.errors` reports the shared slots under; a program's own
#: slots are added per program with :meth:`Program.name_errors`.
ERROR_NAMES: Mapping[int, str] = {ERR_MAP_FULL: "map_full", ERR_READ: "read"}

#: ``kind`` of :meth:`Program.load_function` -> ``enum bpf_prog_type`` (uapi/linux/bpf.h).
#: A tail-called function must have the type of the program that calls it
#: (uprobes are ``kprobe`` programs).
PROG_TYPES: Mapping[str, int] = {
    "socket_filter": 1, "kprobe": 2, "tracepoint": 5, "xdp": 6, "perf_event": 7, "raw_tracepoint": 17,
}

#: ``exist`` of :meth:`Program.update_map` -> ``BPF_ANY``/``BPF_NOEXIST``/``BPF_EXIST`` (uapi/linux/bpf.h).
UPDATE_FLAGS: Mapping[str, int] = {"any": 0, "noexist": 1, "exist": 2}

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


_PROBE_MACRO = re.compile(r"^\s*(RAW_TRACEPOINT_PROBE|TRACEPOINT_PROBE)\(\s*(\w+)\s*(?:,\s*(\w+)\s*)?\)", re.M)


def program_tracepoints(name: str) -> tuple[tuple[str, str], ...]:
    """``(category, event)`` of every ``TRACEPOINT_PROBE`` in ``bpf/<name>.bpf.c``, in source
    order, and ``("raw", event)`` for a ``RAW_TRACEPOINT_PROBE``: what the program attaches to,
    read from the program itself (needs neither bcc nor root). Some sit under ``#if``: a
    feature the kernel lacks compiles them out."""
    text = (BPF_DIR / f"{name}.bpf.c").read_text()
    out: list[tuple[str, str]] = []
    for macro, first, second in _PROBE_MACRO.findall(text):
        point = ("raw", first) if macro == "RAW_TRACEPOINT_PROBE" else (first, second)
        if point not in out:
            out.append(point)
    return tuple(out)


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
        #: ``llmdiag_errors`` slot -> the name :meth:`errors` reports it under.
        self.error_names: dict[int, str] = dict(ERROR_NAMES)
        # pid -> (what, bcc event names) of the uprobes attached for that pid only.
        self._uprobes: dict[int, list[tuple[str, list[bytes]]]] = {}
        self._closed = False
        self._close_lock = threading.Lock()
        # Map name -> its batch reader; None once the kernel refused batches for that map. The
        # readers' buffers are shared, so reads take the lock (reads used to be safe from any thread).
        self._readers: dict[str, BatchReader | None] = {}
        # map name -> key bytes -> (value bytes, plain key, plain value) of its last shared read.
        self._plain: dict[str, dict[bytes, tuple[bytes, Any, Any]]] = {}
        self._read_lock = threading.Lock()
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
        self._attach_user(f"uprobe:{library}:{symbol}", pid,
                          lambda: self.bpf.attach_uprobe(name=library.encode(), sym=symbol.encode(),
                                                         fn_name=fn_name.encode(), pid=pid))

    def attach_uretprobe(self, library: str, symbol: str, fn_name: str, pid: int = -1) -> None:
        self._attach_user(f"uretprobe:{library}:{symbol}", pid,
                          lambda: self.bpf.attach_uretprobe(name=library.encode(), sym=symbol.encode(),
                                                            fn_name=fn_name.encode(), pid=pid))

    def _attach_user(self, what: str, pid: int, fn: Callable[[], Any]) -> None:
        before = set(self.bpf.uprobe_fds)
        self._attach(what, fn)
        if pid != -1:
            events = [ev for ev in self.bpf.uprobe_fds if ev not in before]
            self._uprobes.setdefault(pid, []).append((what, events))

    def detach_uprobes(self, pid: int) -> int:
        """Detach every uprobe and uretprobe attached with this ``pid``; returns how many.

        By the probe events recorded at attach time, not by symbol: bcc's
        ``detach_uprobe`` resolves the symbol again through the path it was given
        (``/proc/PID/root/...``), which is gone once the process has exited, and that
        is exactly when a tracer detaches. Detach errors are logged, never raised."""
        detached = 0
        for what, events in self._uprobes.pop(pid, []):
            with contextlib.suppress(ValueError):
                self.attached.remove(what)
            for event in events:
                if self._closed or event not in self.bpf.uprobe_fds:
                    continue
                try:
                    self.bpf.detach_uprobe_event(event)
                except Exception as exc:  # noqa: BLE001 - bcc raises plain Exception
                    log.warning("BPF program %s: detaching %s of pid %d failed: %s", self.name, what, pid, exc)
                else:
                    detached += 1
        return detached

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

    # -- tail calls -------------------------------------------------------------
    def load_function(self, fn_name: str, kind: str = "tracepoint") -> int:
        """Load (verify) ``fn_name`` as a ``kind`` program (:data:`PROG_TYPES`) without
        attaching it; returns its fd, owned by the program (closed by :meth:`close`).
        For tail calls: put the fd into a prog array with :meth:`set_prog_array`.
        A verifier rejection raises :class:`BPFUnavailable` with the verifier's words."""
        if kind not in PROG_TYPES:
            raise ValueError(f"unknown program kind {kind!r}; one of {', '.join(sorted(PROG_TYPES))}")
        self._require_open()
        with features.captured_stderr() as captured:
            try:
                fd = int(self.bpf.load_func(fn_name.encode(), PROG_TYPES[kind]).fd)
            except Exception as exc:  # noqa: BLE001 - bcc raises bare Exception on verifier errors
                error: Exception | None = exc
            else:
                error = None
        if error is not None:
            detail = _first_error_lines(captured.text)
            raise BPFUnavailable(f"loading {fn_name} of {self.name} failed: {error}" + (f": {detail}" if detail else ""),
                                 "the verifier's log is in the reason; see `llmdiag doctor`") from error
        return fd

    def set_prog_array(self, map_name: str, index: int, fd: int) -> None:
        """``map_name[index] = fd`` in a ``BPF_PROG_ARRAY``: ``map_name.call(ctx, index)``
        in the program then jumps to that function. Raises :class:`BPFUnavailable` when
        the kernel refuses (an fd of another program type, an index out of range)."""
        if index < 0:
            raise ValueError(f"prog array index must be >= 0, not {index}")
        self._require_open()
        prog_array = self.table(map_name)  # KeyError for a map the program does not have
        try:
            prog_array[ctypes.c_int(index)] = ctypes.c_int(fd)
        except Exception as exc:  # noqa: BLE001 - bcc raises bare Exception
            raise BPFUnavailable(f"{self.name}: setting {map_name}[{index}] to fd {fd} failed: {exc}",
                                 "a tail-called function must have its caller's program type") from exc

    # -- maps -----------------------------------------------------------------
    def table(self, name: str) -> Any:
        """The bcc table object of map ``name`` (``KeyError`` if there is none).

        Public API: its ``Key``/``Leaf`` ctypes types build keys and values for
        :meth:`update_map`; ``keys()``, ``items()`` and ``del table[key]`` read and
        delete entries. Plain reads are simpler through :meth:`read_hash`/:meth:`read_array`.

        The same object every time: bcc's ``get_table`` builds new ctypes types from the
        map's JSON description on each call (milliseconds, and new types each tick)."""
        return self.bpf[name.encode()]

    def update_map(self, name: str, key: Any, value: Any, exist: str = "any") -> bool:
        """Write ``key -> value`` into map ``name``; ``exist`` is ``"any"`` (insert or
        overwrite), ``"noexist"`` (insert only: an entry the program created
        meanwhile keeps its state) or ``"exist"`` (overwrite only).

        ``key`` and ``value`` are instances of the table's ``Key``/``Leaf`` types,
        ints (scalar types) or mappings of field name -> value (struct types).
        Returns ``False`` when ``exist`` refused the write (``EEXIST``/``ENOENT``),
        ``True`` when it was written; any other failure raises :class:`OSError`
        (``E2BIG`` is a full hash map)."""
        if exist not in UPDATE_FLAGS:
            raise ValueError(f"exist must be one of {', '.join(UPDATE_FLAGS)}, not {exist!r}")
        self._require_open()
        from bcc.libbcc import lib  # noqa: PLC0415 - lazy: bcc is optional

        table = self.table(name)
        c_key = _as_ctype(table.Key, key, f"{name} key")
        c_value = _as_ctype(table.Leaf, value, f"{name} value")
        if lib.bpf_update_elem(ctypes.c_int(table.map_fd), ctypes.byref(c_key), ctypes.byref(c_value),
                               ctypes.c_ulonglong(UPDATE_FLAGS[exist])) == 0:
            return True
        err = ctypes.get_errno()
        if (exist, err) in (("noexist", errno.EEXIST), ("exist", errno.ENOENT)):
            return False
        what = "map full" if err == errno.E2BIG else os.strerror(err)
        raise OSError(err, f"{self.name}: updating map {name} failed: {what}")

    def _read_all(self, name: str, delete: bool = False) -> list[tuple[Any, Any]]:
        """Every entry of map ``name`` as ctypes pairs, by batch lookup where the kernel has it
        (:mod:`llmdiag.bpf.maps`), else key by key."""
        table = self.table(name)
        with self._read_lock:
            if name in self._readers:
                reader = self._readers[name]
            else:
                reader = BatchReader(table) if _batchable(table, delete) else None
            raw, self._readers[name] = lookup_all(table, reader, delete=delete)
        return raw

    def read_hash(self, name: str, clear: bool = False, shared: bool = False) -> list[tuple[Any, Any]]:
        """All entries of a hash map as ``(key, value)`` pairs of plain Python data
        (see :func:`plain`). Cumulative by default; ``clear=True`` deletes what was read.

        ``shared=True``: an entry whose key and value bytes are what they were at this map's
        last shared read gives that read's plain objects again instead of converting anew
        (most entries of a cumulative map repeat between ticks). The caller must not change them."""
        table = self.table(name)
        raw = self._read_all(name, delete=clear)
        key_plain, value_plain = converter(table.Key), converter(table.Leaf)
        if not shared:
            return [(key_plain(k), value_plain(v)) for k, v in raw]
        last = self._plain.get(name, {})
        now: dict[bytes, tuple[bytes, Any, Any]] = {}
        out = []
        for k, v in raw:
            key_bytes, value_bytes = bytes(k), bytes(v)
            seen = last.get(key_bytes)
            if seen is None or seen[0] != value_bytes:
                seen = (value_bytes, key_plain(k), value_plain(v))
            now[key_bytes] = seen
            out.append((seen[1], seen[2]))
        self._plain[name] = now
        return out

    def read_array(self, name: str) -> list[int]:
        """An array of integers as a list (per-CPU arrays are summed over CPUs)."""
        table = self.table(name)
        if not _batchable(table, False):  # per-CPU: bcc's reducer-aware lookup, index by index
            out: list[int] = []
            for i in range(len(table)):
                value = table[table.Key(i)]
                if isinstance(value, (list, tuple)) or hasattr(value, "__len__") and not hasattr(value, "value"):
                    out.append(int(sum(int(getattr(v, "value", v)) for v in value)))
                else:
                    out.append(int(getattr(value, "value", value)))
            return out
        values = [0] * len(table)
        for key, value in self._read_all(name):
            index = int(getattr(key, "value", key))
            if 0 <= index < len(values):
                values[index] = int(getattr(value, "value", value))
        return values

    def name_errors(self, names: Mapping[int, str]) -> None:
        """Name this program's own ``llmdiag_errors`` slots (beyond :data:`ERROR_NAMES`),
        e.g. ``{2: "tail_call"}``; a slot or a name already taken by another raises ``ValueError``."""
        for slot, name in names.items():
            if not isinstance(slot, int) or slot < 0 or not re.fullmatch(r"[a-z][a-z0-9_]*", name):
                raise ValueError(f"bad error slot {slot!r} -> {name!r}")
            taken = {n: s for s, n in self.error_names.items()} | {"lost_events": -1}
            if self.error_names.get(slot, name) != name or taken.get(name, slot) != slot:
                raise ValueError(f"error slot {slot} -> {name!r} clashes with {self.error_names}")
            self.error_names[slot] = name

    def errors(self) -> dict[str, int]:
        """Every slot of ``llmdiag_errors`` (common.h): named slots (:attr:`error_names`)
        always, unnamed ones as ``slot_<i>`` when not zero, plus ``lost_events``."""
        counts = {"lost_events": self.lost_events_total}
        if self._closed:
            return counts
        try:
            errors = self.read_array("llmdiag_errors")
        except KeyError:
            return counts
        for slot, count in enumerate(errors):
            name = self.error_names.get(slot)
            if name is not None:
                counts[name] = count
            elif count:
                counts[f"slot_{slot}"] = count
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

    def _require_open(self) -> None:
        if self._closed:
            raise BPFUnavailable(f"BPF program {self.name} is closed")

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
        self._uprobes.clear()

    def __enter__(self) -> Program:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def plain(value: Any) -> Any:
    """ctypes data from a bcc table as Python data: integers stay integers, a
    struct becomes a dict of its fields, a byte array ``bytes``, other arrays lists."""
    if isinstance(value, ctypes.Structure | ctypes.Union | ctypes.Array | ctypes._SimpleCData):
        return converter(type(value))(value)
    return value


#: bcc table classes whose entries batch lookups read as plain Key/Leaf pairs. Per-CPU maps
#: (whose Leaf bcc rewrites into a per-CPU array) and others keep bcc's own iteration.
_BATCH_TABLES = {"HashTable": (True, True), "LruHash": (True, True), "Array": (True, False)}


def _batchable(table: Any, delete: bool) -> bool:
    """Whether ``table`` can be read with batch lookups (``delete``: and deleted; arrays cannot)."""
    lookup, deletable = _BATCH_TABLES.get(type(table).__name__, (False, False))
    return lookup and (deletable or not delete)


def _as_ctype(ctype: Any, value: Any, what: str) -> Any:
    """``value`` as an instance of a table's Key/Leaf type: kept as is, built from an
    int (scalar types) or from a mapping of field names (structs)."""
    if isinstance(value, ctype):
        return value
    if isinstance(value, Mapping):
        fields = {name for name, *_ in getattr(ctype, "_fields_", ())}
        unknown = set(value) - fields
        if unknown or not fields:
            raise ValueError(f"{what}: unknown field(s) {sorted(unknown)}; fields are {sorted(fields)}")
        out = ctype()
        for name, field_value in value.items():
            setattr(out, name, field_value)
        return out
    if isinstance(value, int) and not isinstance(value, bool) and issubclass(ctype, ctypes._SimpleCData):
        return ctype(value)
    raise TypeError(f"{what}: expected {ctype.__name__}, an int or a mapping of fields, not {type(value).__name__}")


def _autoloaded_tracepoints(bpf: Any) -> list[str]:
    # bcc attaches every tracepoint__<cat>__<event> function itself (TRACEPOINT_PROBE).
    names = []
    for tp in getattr(bpf, "tracepoint_fds", {}) or {}:
        names.append(tp.decode() if isinstance(tp, bytes) else str(tp))
    return sorted(names)

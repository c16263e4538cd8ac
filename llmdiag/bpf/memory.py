"""Give back the memory bcc's compiler leaves behind once every BPF program is loaded.

bcc compiles each program at start with the clang and LLVM linked into libbcc.
In a long-running agent that costs resident memory for good, twice over
(measured on Debian bookworm's bcc 0.26 / LLVM 14, tcp and cuda programs
loaded; ``bench/bench_agent_cost.py``, docs/benchmarks.md):

* **heap**: clang and LLVM free their compile-time allocations, but glibc keeps
  the freed pages in the process (~50 MiB of ~110 MiB anonymous memory).
  ``malloc_trim(0)`` returns free pages at the top of the heap *and* free runs in
  its middle (glibc >= 2.8 walks all arenas with ``MADV_DONTNEED``); it touches
  only memory malloc already considers free, so it is always safe.
* **mapped code**: the compile faulted in ~75 MiB of ``libLLVM``/``libclang-cpp``
  text. Those pages are clean and file-backed, but they count in the agent's RSS
  (and so in a container's memory accounting) until the kernel needs memory.
  ``madvise(MADV_PAGEOUT)`` (Linux 5.4) on their *read-only private* mappings
  asks the kernel to reclaim them now. It never discards data: a clean file page
  is re-read from the page cache or the file if the code is ever run again (a
  later compile only gets slower), and the kernel skips pages other processes
  also map. Writable mappings are never touched, so relocated data and the
  libraries' globals stay as they are. Where ``MADV_PAGEOUT`` is unknown
  (``EINVAL``), ``MADV_COLD`` (also 5.4) only marks the pages as first to go;
  on older kernels nothing happens and the result says so.

:func:`release_compiler_memory` does both and reports ``RssAnon``/``RssFile``
before and after; :func:`compiler_mappings` is the pure selection, testable on
a recorded ``/proc/PID/maps``.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["COMPILER_LIBRARY", "Released", "compiler_mappings", "release_compiler_memory", "rss_kib"]

log = logging.getLogger("llmdiag.bpf")

#: The libraries bcc compiles with: libbcc itself (Debian's links LLVM in dynamically,
#: other builds statically), LLVM and clang.
COMPILER_LIBRARY = re.compile(r"/lib(?:bcc|LLVM|clang|clang-cpp)[-.][^/]*$")

MADV_COLD = 20  # uapi/asm-generic/mman-common.h, Linux 5.4
MADV_PAGEOUT = 21

#: ``madvise(addr, length, advice)``: 0 or -1 with errno set.
Madvise = Callable[[int, int, int], int]


@dataclass(frozen=True)
class Released:
    """What :func:`release_compiler_memory` did. Sizes in KiB from ``/proc/self/status``
    (``None`` where it could not be read)."""

    anon_before_kib: int | None
    anon_after_kib: int | None
    file_before_kib: int | None
    file_after_kib: int | None
    trimmed: bool  # malloc_trim ran (glibc only)
    mappings: int  # compiler mappings advised
    advice: str  # "pageout", "cold", or "none: <why>"

    def describe(self) -> str:
        def mib(kib: int | None) -> str:
            return "?" if kib is None else f"{kib / 1024:.0f}"

        return (f"anon RSS {mib(self.anon_before_kib)} -> {mib(self.anon_after_kib)} MiB "
                f"(malloc_trim {'done' if self.trimmed else 'unavailable'}), mapped files "
                f"{mib(self.file_before_kib)} -> {mib(self.file_after_kib)} MiB "
                f"({self.mappings} compiler mappings, advice {self.advice})")


def compiler_mappings(maps_text: str) -> list[tuple[int, int, str]]:
    """``(start, end, path)`` of every read-only private file mapping of a compiler library
    (:data:`COMPILER_LIBRARY`) in a ``/proc/PID/maps`` text. Lines that do not parse are skipped."""
    out: list[tuple[int, int, str]] = []
    for line in maps_text.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) < 6:
            continue  # anonymous mapping (no path)
        span, perms, path = parts[0], parts[1], parts[5].strip()
        # perms is "rwxp"/"r-xs"...: only private ('p') mappings that are not writable.
        if len(perms) != 4 or perms[1] != "-" or perms[3] != "p" or path.endswith("(deleted)"):
            continue
        if not COMPILER_LIBRARY.search(path):
            continue
        start_text, _, end_text = span.partition("-")
        try:
            start, end = int(start_text, 16), int(end_text, 16)
        except ValueError:
            continue
        if end > start:
            out.append((start, end, path))
    return out


def rss_kib(status_text: str, key: str) -> int | None:
    """``key`` (``RssAnon``, ``RssFile``...) in KiB from a ``/proc/PID/status`` text."""
    for line in status_text.splitlines():
        name, _, value = line.partition(":")
        if name == key:
            try:
                return int(value.split()[0])
            except (IndexError, ValueError):
                return None
    return None


def _libc() -> Any:
    """The process's C library, with the prototypes used here."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes, libc.madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    trim = getattr(libc, "malloc_trim", None)  # glibc only (musl has none)
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return libc


def release_compiler_memory(proc_self: Path = Path("/proc/self"), libc: Any = None,
                            madvise: Madvise | None = None) -> Released:
    """``malloc_trim(0)``, then ``MADV_PAGEOUT`` on the compiler's read-only mappings (see the
    module docstring). Call it after the last program is compiled and loaded. Never raises
    for a missing function, file or kernel feature: the result says what was done."""

    def status(key: str) -> int | None:
        try:
            return rss_kib((proc_self / "status").read_text(), key)
        except OSError:
            return None

    anon_before, file_before = status("RssAnon"), status("RssFile")
    libc = libc if libc is not None else _libc()
    trimmed = False
    trim = getattr(libc, "malloc_trim", None)  # glibc only (musl has none)
    if trim is not None:
        trim(0)
        trimmed = True
    if madvise is None:
        madvise = libc.madvise
    try:
        mappings = compiler_mappings((proc_self / "maps").read_text())
    except OSError as exc:
        mappings, advice = [], f"none: cannot read {proc_self / 'maps'}: {exc.strerror}"
    else:
        advice = _advise(mappings, madvise)
    return Released(anon_before, status("RssAnon"), file_before, status("RssFile"), trimmed, len(mappings), advice)


def _advise(mappings: list[tuple[int, int, str]], madvise: Madvise) -> str:
    if not mappings:
        return "none: no compiler library mapped"
    advice, name = MADV_PAGEOUT, "pageout"
    failures: list[str] = []
    for start, end, path in mappings:
        if madvise(start, end - start, advice) == 0:
            continue
        err = ctypes.get_errno()
        if err == errno.EINVAL and advice == MADV_PAGEOUT:
            # Kernel before 5.4 or built without it: try the weaker hint on the same range.
            advice, name = MADV_COLD, "cold"
            if madvise(start, end - start, advice) == 0:
                continue
            err = ctypes.get_errno()
        if err == errno.EINVAL:
            return "none: this kernel has neither MADV_PAGEOUT nor MADV_COLD (Linux 5.4)"
        failures.append(f"{Path(path).name}: {errno.errorcode.get(err, str(err))}")
    if failures:
        log.debug("madvise failed on %d compiler mappings: %s", len(failures), "; ".join(failures[:3]))
        return f"{name} ({len(failures)} of {len(mappings)} mappings refused)"
    return name

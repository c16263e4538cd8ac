"""Giving back the BPF compiler's memory (llmdiag.bpf.memory): which mappings are advised,
the MADV_PAGEOUT -> MADV_COLD fallback, a libc without malloc_trim, an unreadable /proc."""

from __future__ import annotations

import ctypes
import errno
from pathlib import Path

from llmdiag.bpf.memory import MADV_COLD, MADV_PAGEOUT, compiler_mappings, release_compiler_memory, rss_kib

MAPS = """\
55d0c0000000-55d0c0100000 r--p 00000000 fd:01 100 /usr/bin/python3.11
7f0000000000-7f0002e00000 r-xp 00a00000 fd:01 200 /usr/lib/x86_64-linux-gnu/libLLVM-14.so.1
7f0002e00000-7f0003500000 r--p 03400000 fd:01 200 /usr/lib/x86_64-linux-gnu/libLLVM-14.so.1
7f0003500000-7f0003600000 rw-p 03b00000 fd:01 200 /usr/lib/x86_64-linux-gnu/libLLVM-14.so.1
7f0004000000-7f0005800000 r-xp 00400000 fd:01 300 /usr/lib/llvm-14/lib/libclang-cpp.so.14
7f0006000000-7f0006100000 r-xp 00100000 fd:01 400 /usr/lib/x86_64-linux-gnu/libbcc.so.0.26.0
7f0007000000-7f0007100000 r-xs 00000000 fd:01 500 /usr/lib/x86_64-linux-gnu/libclang-cpp.so.14
7f0008000000-7f0008100000 r-xp 00000000 fd:01 600 /usr/lib/x86_64-linux-gnu/libLLVMish-helper.so (deleted)
7f0009000000-7f0009100000 r-xp 00000000 fd:01 700 /opt/notLLVM/libfoo.so
7f000a000000-7f000a100000 rw-p 00000000 00:00 0
garbage line
zz-yy r-xp 0 fd:01 1 /usr/lib/libLLVM-15.so
"""

STATUS = "Name:\tpython3\nRssAnon:\t  120000 kB\nRssFile:\t  100000 kB\n"


def test_only_read_only_private_compiler_mappings_are_chosen() -> None:
    chosen = compiler_mappings(MAPS)
    assert [(hex(s), Path(p).name) for s, _, p in chosen] == [
        ("0x7f0000000000", "libLLVM-14.so.1"),  # code
        ("0x7f0002e00000", "libLLVM-14.so.1"),  # read-only data
        ("0x7f0004000000", "libclang-cpp.so.14"),
        ("0x7f0006000000", "libbcc.so.0.26.0"),
    ]  # never: writable (rw-p), shared (r-xs), deleted files, other libraries, bad lines
    assert chosen[0][1] - chosen[0][0] == 0x2E00000


def test_rss_fields_are_read_and_missing_ones_are_none() -> None:
    assert rss_kib(STATUS, "RssAnon") == 120000
    assert rss_kib(STATUS, "VmSwap") is None
    assert rss_kib("RssAnon:\tlots kB\n", "RssAnon") is None


class FakeLibc:
    def __init__(self) -> None:
        self.trims: list[int] = []

    def malloc_trim(self, pad: int) -> int:
        self.trims.append(pad)
        return 1


def _proc(tmp_path: Path, maps: str = MAPS) -> Path:
    (tmp_path / "status").write_text(STATUS)
    (tmp_path / "maps").write_text(maps)
    return tmp_path


def test_release_trims_the_heap_and_pages_out_each_mapping(tmp_path: Path) -> None:
    calls: list[tuple[int, int, int]] = []
    libc = FakeLibc()

    def madvise(start: int, length: int, advice: int) -> int:
        calls.append((start, length, advice))
        return 0

    released = release_compiler_memory(_proc(tmp_path), libc=libc, madvise=madvise)
    assert libc.trims == [0]
    assert [(hex(s), advice) for s, _, advice in calls] == [
        ("0x7f0000000000", MADV_PAGEOUT), ("0x7f0002e00000", MADV_PAGEOUT),
        ("0x7f0004000000", MADV_PAGEOUT), ("0x7f0006000000", MADV_PAGEOUT)]
    assert (released.trimmed, released.mappings, released.advice) == (True, 4, "pageout")
    assert (released.anon_before_kib, released.file_after_kib) == (120000, 100000)
    assert "anon RSS 117 -> 117 MiB" in released.describe()


def test_a_kernel_without_pageout_gets_cold_and_one_without_either_is_said(tmp_path: Path) -> None:
    seen: list[int] = []

    def no_pageout(start: int, length: int, advice: int) -> int:
        seen.append(advice)
        if advice == MADV_PAGEOUT:
            ctypes.set_errno(errno.EINVAL)
            return -1
        return 0

    released = release_compiler_memory(_proc(tmp_path), libc=FakeLibc(), madvise=no_pageout)
    assert released.advice == "cold"
    assert seen == [MADV_PAGEOUT, MADV_COLD, MADV_COLD, MADV_COLD, MADV_COLD]  # asks for PAGEOUT once only

    def neither(start: int, length: int, advice: int) -> int:
        ctypes.set_errno(errno.EINVAL)
        return -1

    released = release_compiler_memory(_proc(tmp_path), libc=FakeLibc(), madvise=neither)
    assert released.advice.startswith("none: this kernel has neither")


def test_refused_mappings_are_counted_without_raising(tmp_path: Path) -> None:
    def refuse_code(start: int, length: int, advice: int) -> int:
        if start == 0x7F0000000000:
            ctypes.set_errno(errno.EPERM)
            return -1
        return 0

    released = release_compiler_memory(_proc(tmp_path), libc=FakeLibc(), madvise=refuse_code)
    assert released.advice == "pageout (1 of 4 mappings refused)"


def test_no_malloc_trim_no_compiler_and_no_proc_are_reported_not_raised(tmp_path: Path) -> None:
    released = release_compiler_memory(_proc(tmp_path, maps=""), libc=object(), madvise=lambda *a: 0)
    assert (released.trimmed, released.mappings, released.advice) == (False, 0, "none: no compiler library mapped")
    assert "malloc_trim unavailable" in released.describe()
    released = release_compiler_memory(tmp_path / "missing", libc=FakeLibc(), madvise=lambda *a: 0)
    assert released.advice.startswith("none: cannot read")
    assert released.anon_before_kib is None and "anon RSS ? -> ? MiB" in released.describe()


def test_release_on_this_process_never_raises() -> None:
    # The real libc and /proc/self, malloc_trim runs (glibc). The compiler is mapped here only when
    # an earlier test in this process loaded bcc (the root tier): then its code pages are released.
    mapped = len(compiler_mappings(Path("/proc/self/maps").read_text()))
    released = release_compiler_memory()
    assert released.anon_after_kib is not None
    assert (released.mappings > 0) if mapped else (released.mappings == 0)

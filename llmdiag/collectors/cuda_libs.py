"""Finding the CUDA driver library of a process, and what it exports.

Three small readers for the CUDA allocation tracer, each on an overridable
``proc_root`` so tests run on recorded files:

* :func:`find_library` reads ``/proc/PID/maps`` for the first mapping whose
  file name starts with ``libcuda.so`` (the driver; ``libcudart.so``, the
  runtime that calls it, does not match);
* :func:`exported_functions` reads the ELF dynamic symbol table (``.dynsym``)
  of that file and returns the names of the functions it defines, so the
  tracer attaches only to entry points the installed driver has
  (``cuMemAllocAsync`` arrived in CUDA 11.2, ``cuMemCreate`` in 10.2);
* :func:`descendants` finds the processes under the engines' pids, because
  engines allocate GPU memory in child processes: down the kernel's
  ``/proc/PID/task/TID/children`` lists where it has them, else (or when that
  would read more files) by walking ``/proc/*/stat`` parent links.

Processes vanish mid-read: that is "gone" (``None`` or absent), not an error.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ElfError", "MappedLibrary", "descendants", "exported_functions", "find_library", "parse_maps"]

_DELETED = " (deleted)"


@dataclass(frozen=True)
class MappedLibrary:
    """A library mapping: ``path`` as the process sees it (its own mount namespace),
    and ``deleted`` when the file was replaced after it was mapped (a driver upgrade
    under a running engine): probes on the new file would never fire in this process."""

    path: str
    deleted: bool = False


def parse_maps(text: str, names: Iterable[str]) -> MappedLibrary | None:
    """The first mapped file in ``/proc/PID/maps`` text whose base name starts with one of ``names``."""
    prefixes = tuple(names)
    if not any(prefix in text for prefix in prefixes):
        # A base name that starts with a prefix contains it: one substring search decides for the
        # usual process without the driver, before any line is split (a rescan reads many).
        return None
    for line in text.splitlines():
        # address perms offset dev inode [pathname]; the pathname may contain spaces.
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or not fields[5].startswith("/"):
            continue
        path = fields[5]
        deleted = path.endswith(_DELETED)
        if deleted:
            path = path[: -len(_DELETED)]
        if os.path.basename(path).startswith(prefixes):
            return MappedLibrary(path, deleted)
    return None


def find_library(pid: int, names: Iterable[str], proc_root: str | Path = "/proc") -> MappedLibrary | None:
    """The CUDA library ``pid`` has mapped, or ``None`` (not mapped, or the process is gone)."""
    try:
        text = _read_proc(os.path.join(str(proc_root), str(pid), "maps")).decode("utf-8", "replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    return parse_maps(text, names)


def _read_proc(path: str) -> bytes:
    """A whole /proc file in bytes, with plain os calls (no text layer: a rescan reads ~100)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


class ElfError(ValueError):
    """A file that is not an ELF shared object this reader understands."""


_SHT_DYNSYM = 11
_STT_FUNC, _STT_GNU_IFUNC = 2, 10
_STB_GLOBAL, _STB_WEAK = 1, 2


def exported_functions(path: str | Path) -> set[str]:
    """Names of the functions an ELF64 little-endian shared object defines and exports
    (``.dynsym``: FUNC or IFUNC, GLOBAL or WEAK, not undefined). Reads only the section
    headers and the two tables, not the whole file (libcuda.so is over 30 MB)."""
    with open(path, "rb") as fh:
        ident = fh.read(64)
        if len(ident) < 64 or ident[:4] != b"\x7fELF":
            raise ElfError(f"{path}: not an ELF file")
        if ident[4] != 2 or ident[5] != 1:
            raise ElfError(f"{path}: only 64-bit little-endian ELF is supported (class {ident[4]}, data {ident[5]})")
        shoff, = struct.unpack_from("<Q", ident, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", ident, 0x3A)
        if shoff == 0 or shnum == 0 or shentsize < 64:
            raise ElfError(f"{path}: no section headers")
        fh.seek(shoff)
        table = fh.read(shentsize * shnum)
        if len(table) < shentsize * shnum:
            raise ElfError(f"{path}: truncated section header table")
        sections = [struct.unpack_from("<IIQQQQIIQQ", table, i * shentsize) for i in range(shnum)]
        dynsym = next((s for s in sections if s[1] == _SHT_DYNSYM), None)
        if dynsym is None:
            raise ElfError(f"{path}: no .dynsym (not a shared object?)")
        link = dynsym[6]
        if link >= shnum:
            raise ElfError(f"{path}: .dynsym links to a missing string table")
        symbols = _read(fh, dynsym[4], dynsym[5], path)
        strings = _read(fh, sections[link][4], sections[link][5], path)
    entsize = dynsym[9] or 24
    names: set[str] = set()
    for offset in range(0, len(symbols) - entsize + 1, entsize):
        st_name, st_info, _other, st_shndx = struct.unpack_from("<IBBH", symbols, offset)
        if st_shndx == 0 or st_info & 0xF not in (_STT_FUNC, _STT_GNU_IFUNC):
            continue
        if st_info >> 4 not in (_STB_GLOBAL, _STB_WEAK):
            continue
        end = strings.find(b"\0", st_name)
        if end > st_name:
            names.add(strings[st_name:end].decode("ascii", errors="replace"))
    return names


def _read(fh, offset: int, size: int, path: str | Path) -> bytes:  # type: ignore[no-untyped-def]
    fh.seek(offset)
    data = fh.read(size)
    if len(data) < size:
        raise ElfError(f"{path}: section at {offset:#x} runs past the end of the file")
    return data


def _parent_of(stat_text: str) -> int | None:
    # "pid (comm) state ppid ...": comm may contain spaces and ')', so split at the last ')'.
    _, sep, rest = stat_text.rpartition(")")
    fields = rest.split()
    if not sep or len(fields) < 2:
        return None
    try:
        return int(fields[1])
    except ValueError:
        return None


def _vsize_of(stat_text: str) -> int | None:
    fields = stat_text.rpartition(")")[2].split()
    try:
        return int(fields[20])  # field 23, vsize; fields[0] is field 3, the state
    except (IndexError, ValueError):
        return None


def descendants(roots: Iterable[int], proc_root: str | Path = "/proc", sizes: dict[int, int] | None = None) -> dict[int, int]:
    """Every live process under each root pid (the roots included): ``{tgid: root}``.

    A root that is gone is left out; a process that exits during the search is skipped.
    ``sizes``, when given, receives the virtual memory size (``vsize``) of each process
    returned (and, after a walk, of every other process read).

    Two ways, the same answer: down the ``children`` files of each process's threads
    (``CONFIG_PROC_CHILDREN``; a process's children are the processes whose parent, the
    ``ppid`` of their stat, is one of its threads), reading the tree's own files only; or
    one pass over every ``/proc/*/stat``. The first is taken when the kernel has the files
    and gives up for the second as soon as it has read as many files as the pass would
    (engines with hundreds of threads); a recorded tree without them is always walked.
    """
    root_set = sorted(set(roots))
    proc = str(proc_root)
    try:
        names = [n for n in os.listdir(proc) if n.isdigit()]
    except OSError:
        return {}
    if root_set:
        tree = _down_children(root_set, proc, len(names), sizes)
        if tree is not None:
            return tree
    return _walk(root_set, proc, names, sizes)


def _stat_of(proc: str, pid: int | str) -> bytes | None:
    try:
        return _read_proc(f"{proc}/{pid}/stat")
    except OSError:
        return None


def _down_children(roots: list[int], proc: str, budget: int, sizes: dict[int, int] | None) -> dict[int, int] | None:
    """:func:`descendants` by the ``children`` files, or ``None``: no such files (old kernel,
    recorded tree), or more files to read than ``budget`` (the stat files a walk reads)."""
    owner: dict[int, int] = {}
    reads = 0
    for root in roots:
        stack = [root]
        while stack:
            pid = stack.pop()
            if pid in owner:
                continue
            stat = _stat_of(proc, pid)
            reads += 1
            if stat is None:
                continue  # gone (a root), or exited since its parent listed it
            text = stat.decode("utf-8", "replace")
            if _parent_of(text) is None:
                return None  # not a stat line the walk would use: let the walk judge it
            try:
                tids = os.listdir(f"{proc}/{pid}/task")
            except OSError:
                if os.path.exists(f"{proc}/{pid}/stat"):
                    return None  # a stat without task/: a recorded tree
                continue  # exited between the two reads
            reads += len(tids)
            if reads > budget:
                return None
            children: list[int] = []
            for tid in tids:
                try:
                    listed = _read_proc(f"{proc}/{pid}/task/{tid}/children")
                except FileNotFoundError:
                    if os.path.isdir(f"{proc}/{pid}/task/{tid}"):
                        return None  # the thread is there, its children file is not: no CONFIG_PROC_CHILDREN
                    continue  # the thread exited
                except OSError:
                    continue
                children.extend(int(c) for c in listed.split())
            owner[pid] = root
            if sizes is not None:
                vsize = _vsize_of(text)
                if vsize is not None:
                    sizes[pid] = vsize
            # Reversed, so the stack pops them in the kernel's order (the walk's order does not matter:
            # callers sort, and the mapping is the same).
            stack.extend(reversed(children))
    return owner


def _walk(roots: list[int], proc: str, names: list[str], sizes: dict[int, int] | None) -> dict[int, int]:
    """:func:`descendants` by one pass over every process's stat (parent links)."""
    parents: dict[int, int] = {}
    for name in names:
        stat = _stat_of(proc, name)
        if stat is None:
            continue
        text = stat.decode("utf-8", "replace")
        parent = _parent_of(text)
        if parent is not None:
            parents[int(name)] = parent
        if sizes is not None:
            vsize = _vsize_of(text)
            if vsize is not None:
                sizes[int(name)] = vsize
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    owner: dict[int, int] = {}
    for root in roots:
        if root not in parents:
            continue  # gone
        stack = [root]
        while stack:
            pid = stack.pop()
            if pid in owner:  # also guards against a parent loop in recorded data
                continue
            owner[pid] = root
            stack.extend(children.get(pid, ()))
    return owner

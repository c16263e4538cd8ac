"""Kept descriptors for /proc files read every tick: :class:`KeptFiles`, :func:`is_procfs`.

Reading a /proc file by path costs four syscalls (``openat``, ``read``, a
``read`` that returns nothing, ``close``) and the kernel's path walk. A /proc
file is generated afresh on every read from offset 0 (``seq_file`` restarts at
position 0), so a descriptor opened once and read with ``pread(fd, n, 0)``
gives the same content as a fresh open, in one syscall.

What a kept descriptor must not change:

* a per-process file's descriptor stays bound to *that* process: once it has
  exited, a read fails with ``ESRCH`` (or ``ENOENT``) even when the pid has
  been reused. The caller then drops the descriptor and reads by path exactly
  as before, which sees the new process, or finds it gone;
* permissions are checked at ``open`` for some files and at ``read`` for
  others (``/proc/PID/io``): both still happen, an open that fails keeps
  nothing and is tried again the next time;
* a recorded tree (tests, ``proc_root`` pointing at copied files) is not
  regenerated on read and may be replaced file by file, so descriptors are
  only kept on a real procfs mount (:func:`is_procfs`).
"""

from __future__ import annotations

import os

__all__ = ["KeptFiles", "is_procfs", "read_path"]

#: One pread of this size returns a whole single-record /proc file (stat, io, status, PSI, sockstat).
_CHUNK = 65536


def is_procfs(root: str) -> bool:
    """Whether ``root`` is the mount point of a procfs (per ``/proc/self/mounts``)."""
    try:
        real = os.path.realpath(root)
        with open("/proc/self/mounts", "rb") as fh:
            mounts = fh.read()
    except OSError:
        return False
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[2] == b"proc" and parts[1].decode(errors="replace") == real:
            return True
    return False


def read_path(path: str) -> bytes:
    """Read a whole (small) file by path; ``OSError`` passes through."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while True:
            chunk = os.read(fd, _CHUNK)
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def pread_all(fd: int) -> bytes:
    """The whole content of a kept /proc descriptor, from offset 0.

    One ``pread`` normally: a single-record /proc file is copied whole when the buffer
    is larger. Only a read that filled the buffer is followed by another."""
    data = os.pread(fd, _CHUNK, 0)
    if len(data) < _CHUNK:
        return data
    chunks = [data]
    offset = len(data)
    while chunk := os.pread(fd, _CHUNK, offset):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


class KeptFiles:
    """Open descriptors by key (a path, or ``(pid, name)``), owned by one collector.

    Not thread-safe: the collector's tick reads them, :meth:`close_all` at its close."""

    __slots__ = ("_fds",)

    def __init__(self) -> None:
        self._fds: dict[object, int] = {}

    def get(self, key: object) -> int | None:
        return self._fds.get(key)

    def open(self, key: object, path: str, flags: int = os.O_RDONLY) -> int:
        """Open ``path`` and keep the descriptor under ``key``; ``OSError`` passes through (nothing kept)."""
        fd = os.open(path, flags | os.O_CLOEXEC)
        old = self._fds.pop(key, None)
        if old is not None:
            os.close(old)
        self._fds[key] = fd
        return fd

    def read(self, key: object, path: str) -> bytes:
        """The whole file ``path`` through the descriptor kept under ``key``: read at offset 0,
        or, when there is none or it fails (its process exited: the pid may be someone else's
        now), dropped and ``path`` opened again and kept. ``OSError`` of that open or read passes
        through (nothing kept), as a read by path would raise it."""
        fd = self._fds.get(key)
        if fd is not None:
            try:
                return pread_all(fd)
            except OSError:
                self.drop(key)
        try:
            return pread_all(self.open(key, path))
        except OSError:
            self.drop(key)
            raise

    def drop(self, key: object) -> None:
        fd = self._fds.pop(key, None)
        if fd is not None:
            os.close(fd)

    def drop_where(self, keep: object) -> None:
        """Close every descriptor whose key ``keep(key)`` rejects."""
        for key in [k for k in self._fds if not keep(k)]:  # type: ignore[operator]
            self.drop(key)

    def __len__(self) -> int:
        return len(self._fds)

    def close_all(self) -> None:
        for key in list(self._fds):
            self.drop(key)

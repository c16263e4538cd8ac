"""Which (pid, fd) pairs are TCP connections to a backend's listen port, from /proc.

The http2 collector traces only the processes that own a backend's LISTEN
socket, and in them only the file descriptors that are TCP sockets on that
port (the accepted connections). Both come from user-visible files, read
under one ``proc_root`` so tests run on recorded trees:

* ``/proc/net/tcp`` and ``/proc/net/tcp6``: every TCP socket with its local
  port, state and inode (the socket's identity in ``/proc/PID/fd``);
* ``/proc/PID/fd/N``: a link whose text is ``socket:[INODE]`` for sockets.

``/proc/net/tcp*`` shows the sockets of the reader's network namespace
(``/proc/self/net``). A backend in another namespace (a pod engine) is read
through its own process instead (:func:`pid_sockets`: ``/proc/PID/net/tcp*``
is the table of that process's namespace), once the http2 collector knows the
pid (discovery's ``local_backend_pids``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BackendSockets", "TcpSocket", "backend_sockets", "parse_proc_net_tcp", "pid_sockets", "scan_pid_fds"]

_LISTEN = 0x0A  # TCP_LISTEN (include/net/tcp_states.h); /proc/net/tcp prints states in hex
_SOCKET_LINK = re.compile(r"^socket:\[(\d+)\]$")


@dataclass(frozen=True, slots=True)
class TcpSocket:
    inode: int
    local_port: int
    remote_port: int
    state: int  # TCP_* number

    @property
    def listening(self) -> bool:
        return self.state == _LISTEN


def parse_proc_net_tcp(text: str) -> list[TcpSocket]:
    """Rows of ``/proc/net/tcp`` or ``tcp6``. Malformed rows are skipped (a
    row can be cut when a socket closes mid-read); the header line is ignored."""
    sockets: list[TcpSocket] = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        # sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode ...
        if len(fields) < 10:
            continue
        try:
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            remote_port = int(fields[2].rsplit(":", 1)[1], 16)
            state = int(fields[3], 16)
            inode = int(fields[9])
        except (IndexError, ValueError):
            continue
        if inode == 0:  # TIME_WAIT and orphaned sockets have no inode: no fd can point at them
            continue
        sockets.append(TcpSocket(inode, local_port, remote_port, state))
    return sockets


def _read_tcp_tables(proc_root: Path) -> list[TcpSocket]:
    sockets: list[TcpSocket] = []
    for name in ("tcp", "tcp6"):
        try:
            text = (proc_root / "net" / name).read_text(encoding="ascii", errors="replace")
        except OSError:
            continue  # no IPv6 in this kernel, or a restricted /proc
        sockets.extend(parse_proc_net_tcp(text))
    return sockets


def scan_pid_fds(proc_root: Path, pid: int) -> dict[int, int]:
    """``{fd: socket inode}`` for the socket fds of one process ({} if it is gone)."""
    fd_dir = proc_root / str(pid) / "fd"
    out: dict[int, int] = {}
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return out
    for name in names:
        try:
            target = os.readlink(fd_dir / name)
        except OSError:
            continue  # closed between listdir and readlink
        match = _SOCKET_LINK.match(target)
        if match and name.isdigit():
            out[int(name)] = int(match.group(1))
    return out


def _pids(proc_root: Path) -> Iterable[int]:
    try:
        names = os.listdir(proc_root)
    except OSError:
        return []
    return sorted(int(n) for n in names if n.isdigit())


@dataclass(frozen=True)
class BackendSockets:
    """One /proc scan: ``pid_ports`` (pid -> backend ports it listens on) and
    ``connections`` ((pid, fd) -> backend port) for accepted TCP connections."""

    pid_ports: dict[int, tuple[int, ...]]
    connections: dict[tuple[int, int], int]


def backend_sockets(ports: Iterable[int], proc_root: str | os.PathLike[str] = "/proc") -> BackendSockets:
    """Find the pids listening on ``ports`` and their connected sockets on those ports."""
    root = Path(proc_root)
    wanted = set(ports)
    tcp = _read_tcp_tables(root)
    listen_port = {s.inode: s.local_port for s in tcp if s.listening and s.local_port in wanted}
    conn_port = {s.inode: s.local_port for s in tcp if not s.listening and s.local_port in wanted}
    pid_ports: dict[int, tuple[int, ...]] = {}
    connections: dict[tuple[int, int], int] = {}
    if not listen_port:
        return BackendSockets(pid_ports, connections)
    for pid in _pids(root):
        fds = scan_pid_fds(root, pid)
        owned = sorted({listen_port[i] for i in fds.values() if i in listen_port})
        if not owned:
            continue
        pid_ports[pid] = tuple(owned)
        for fd, inode in fds.items():
            port = conn_port.get(inode)
            if port is not None:
                connections[(pid, fd)] = port
    return BackendSockets(pid_ports, connections)


def pid_sockets(pid: int, port: int, proc_root: str | os.PathLike[str] = "/proc") -> list[int] | None:
    """The fds of one process's accepted TCP connections on ``port``, read in the process's own
    network namespace (``/proc/PID/net/tcp*``); None when it does not listen on ``port`` (or is gone)."""
    root = Path(proc_root)
    tcp = _read_tcp_tables(root / str(pid))
    listen = {s.inode for s in tcp if s.listening and s.local_port == port}
    if not listen:
        return None
    accepted = {s.inode for s in tcp if not s.listening and s.local_port == port}
    fds = scan_pid_fds(root, pid)
    if not listen.intersection(fds.values()):
        return None  # the listener is another process's (the pid was reused)
    return sorted(fd for fd, inode in fds.items() if inode in accepted)

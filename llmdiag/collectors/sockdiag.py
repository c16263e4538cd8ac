"""A small sock_diag (NETLINK_SOCK_DIAG) client: TCP sockets per remote ip:port.

This is what ``ss -tan state time-wait`` asks the kernel. The request is an
``inet_diag_req_v2`` (or, for both families at once, the older ``inet_diag_req``)
with a state mask and no extensions, so every reply is a bare ``inet_diag_msg``
(72 bytes) with no attributes; the parser still walks messages by
``nlmsg_len``, with ``struct.unpack_from`` on the receive buffer (30k sockets
in a few ms; see docs/benchmarks.md, "tcp").

The kernel filters by state (the mask). Most of a dump's cost is the kernel
walking its whole TCP hash table, once per request: :func:`dump_tcp` therefore
asks for both address families in one request (the ``TCPDIAG_GETSOCK`` form of
the request, whose family is ``AF_UNSPEC``) rather than one per family, and
counts straight from the receive buffer. A local-port bytecode filter for the
non-TIME_WAIT states was tried and dropped: it needs a second request per
family, and the second walk costs more than the sockets it leaves out.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

__all__ = ["DestinationSockets", "SockDiagError", "TCP_STATES", "dump_tcp", "format_endpoint", "iter_listening", "iter_tcp"]

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 0x1
NLM_F_DUMP = 0x300
NLMSG_ERROR = 2
NLMSG_DONE = 3
IPPROTO_TCP = 6
#: The older request type (struct inet_diag_req): TCP only, and the kernel dumps every family.
TCPDIAG_GETSOCK = 18

#: include/net/tcp_states.h
TCP_STATES = {
    "ESTABLISHED": 1, "SYN_SENT": 2, "SYN_RECV": 3, "FIN_WAIT1": 4, "FIN_WAIT2": 5, "TIME_WAIT": 6,
    "CLOSE": 7, "CLOSE_WAIT": 8, "LAST_ACK": 9, "LISTEN": 10, "CLOSING": 11, "NEW_SYN_RECV": 12,
}
TIME_WAIT = TCP_STATES["TIME_WAIT"]
#: TCP_TIMEWAIT_LEN (include/net/tcp.h): how long a TIME_WAIT socket lives, 60 s.
TIMEWAIT_LEN_MS = 60_000

_NLMSGHDR = struct.Struct("=IHHII")
_REQ = struct.Struct("=BBBBI48s")  # inet_diag_req_v2: family, protocol, ext, pad, states, sockid
# inet_diag_msg after the nlmsghdr: family, state, timer, retrans, sport(be16), dport(be16),
# src(16), dst(16), if, cookie[2], expires, rqueue, wqueue, uid, inode
_MSG = struct.Struct("=BBBB2s2s16s16sIQIIIII")
_MSG_LEN = _NLMSGHDR.size + _MSG.size
#: What dump_tcp reads of each message: family, state, (timer, retrans skipped), sport, dport (big-endian);
#: src at +8 and dst at +24 (16 bytes each), expires (native) at +52: the offsets of ``_MSG``.
_MSG_HEAD = struct.Struct(">BBxxHH")
_EXPIRES = struct.Struct("=I")


class SockDiagError(OSError):
    """The kernel refused the sock_diag dump (no NETLINK_SOCK_DIAG, no permission...)."""


@dataclass
class DestinationSockets:
    """TCP sockets to one remote ip:port."""

    timewait: int = 0
    #: TIME_WAIT sockets younger than the entry window (from their remaining timer).
    timewait_recent: int = 0
    #: Sockets in any state other than TIME_WAIT and LISTEN, per local port in the ephemeral range.
    other_ephemeral: int = 0
    local_ports: set[int] = field(default_factory=set)


def format_endpoint(family: int, addr: bytes, port: int) -> str:
    """``127.0.0.1:8000`` or ``[::1]:8000``; v4-mapped IPv6 is shown as IPv4."""
    if family == socket.AF_INET:
        return f"{socket.inet_ntop(socket.AF_INET, addr[:4])}:{port}"
    ip = ipaddress.IPv6Address(addr[:16])
    if ip.ipv4_mapped is not None:
        return f"{ip.ipv4_mapped}:{port}"
    return f"[{ip.compressed}]:{port}"


_REQ_ALL = struct.Struct("=BBBB48sII")  # inet_diag_req: family, src_len, dst_len, ext, sockid, states, dbs


def _request(family: int, states: int, seq: int) -> bytes:
    if family == socket.AF_UNSPEC:  # both families in one walk of the kernel's hash table
        body = _REQ_ALL.pack(0, 0, 0, 0, b"\0" * 48, states, 0)
        return _NLMSGHDR.pack(_NLMSGHDR.size + len(body), TCPDIAG_GETSOCK, NLM_F_REQUEST | NLM_F_DUMP, seq, 0) + body
    body = _REQ.pack(family, IPPROTO_TCP, 0, 0, states, b"\0" * 48)
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, seq, 0) + body


def _batches(family: int, states: int) -> Iterator[tuple[bytes, list[int]]]:
    """Yield ``(receive buffer, offsets of its inet_diag_msg bodies)`` per ``recv`` of one family's
    dump (``AF_UNSPEC``: every family's)."""
    try:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_SOCK_DIAG)
    except OSError as exc:
        raise SockDiagError(exc.errno, f"cannot open NETLINK_SOCK_DIAG: {exc.strerror}") from None
    with sock:
        sock.settimeout(5.0)
        seq = int.from_bytes(os.urandom(4), "little") or 1
        sock.send(_request(family, states, seq))
        unpack_hdr = _NLMSGHDR.unpack_from
        while True:
            try:
                buf = sock.recv(1 << 20)
            except TimeoutError:
                raise SockDiagError(0, "sock_diag dump timed out") from None
            offset, end = 0, len(buf)
            bodies: list[int] = []
            while offset + _NLMSGHDR.size <= end:
                length, kind, _flags, msg_seq, _pid = unpack_hdr(buf, offset)
                if length < _NLMSGHDR.size:
                    raise SockDiagError(0, f"malformed netlink message (length {length})")
                if msg_seq == seq:
                    if kind == NLMSG_DONE:
                        yield buf, bodies
                        return
                    if kind == NLMSG_ERROR:
                        errno = -struct.unpack_from("=i", buf, offset + _NLMSGHDR.size)[0]
                        if errno:
                            raise SockDiagError(errno, f"sock_diag: {os.strerror(errno)}")
                        yield buf, bodies
                        return
                    if kind in (SOCK_DIAG_BY_FAMILY, TCPDIAG_GETSOCK) and length >= _MSG_LEN and offset + _MSG_LEN <= end:
                        bodies.append(offset + _NLMSGHDR.size)
                offset += (length + 3) & ~3
            yield buf, bodies


def _dump(family: int, states: int) -> Iterator[tuple[int, bytes, int, int, int, int, bytes]]:
    """Yield ``(state, dst_addr, dport, sport, family, expires_ms, src_addr)`` per socket of one family."""
    unpack_msg = _MSG.unpack_from
    for buf, bodies in _batches(family, states):
        for body in bodies:
            (fam, state, _t, _r, sport, dport, src, dst, _if, _cookie,
             expires, _rq, _wq, _uid, _ino) = unpack_msg(buf, body)
            width = 16 if fam == socket.AF_INET6 else 4
            yield (state, bytes(dst[:width]), int.from_bytes(dport, "big"), int.from_bytes(sport, "big"),
                   fam, expires, bytes(src[:width]))


def iter_tcp(
    states: Iterable[str], families: Iterable[int] = (socket.AF_INET, socket.AF_INET6)
) -> Iterator[tuple[int, int, str, str]]:
    """``(state, local_port, remote "ip:port", local "ip:port")`` for every TCP socket in ``states``."""
    mask = 0
    for name in states:
        mask |= 1 << TCP_STATES[name]
    for family in families:
        for state, dst, dport, sport, fam, _expires, src in _dump(family, mask):
            yield state, sport, format_endpoint(fam, dst, dport), format_endpoint(fam, src, sport)


def iter_listening() -> Iterator[tuple[int, bytes, int, int]]:
    """``(family, local address, local port, socket inode)`` of every TCP socket in LISTEN.

    One sock_diag dump for both families (per family if the kernel refuses that form). The
    kernel walks only its listening hash for it, where ``/proc/net/tcp`` prints every socket
    of the host, TIME_WAIT ones included (16 ms of CPU with ~900 of them, against well
    under 1 ms here)."""
    mask = 1 << TCP_STATES["LISTEN"]
    unpack_msg = _MSG.unpack_from
    try:
        batches = list(_batches(socket.AF_UNSPEC, mask))
    except SockDiagError:
        batches = [batch for family in (socket.AF_INET, socket.AF_INET6) for batch in _batches(family, mask)]
    for buf, bodies in batches:
        for body in bodies:
            fam, _state, _t, _r, sport, _dport, src, _dst, _if, _cookie, _exp, _rq, _wq, _uid, inode = unpack_msg(buf, body)
            width = 16 if fam == socket.AF_INET6 else 4
            yield fam, bytes(src[:width]), int.from_bytes(sport, "big"), inode


def dump_tcp(
    states: Iterable[str] = ("TIME_WAIT",),
    families: Iterable[int] = (socket.AF_INET, socket.AF_INET6),
    ephemeral: range | None = None,
    recent_ms: int = 10_000,
    exclude: frozenset[tuple[int, int]] = frozenset(),
) -> dict[str, DestinationSockets]:
    """TCP sockets in ``states`` grouped by remote ``ip:port``.

    ``ephemeral`` (local ports that count as client ports) enables
    ``other_ephemeral``; ``recent_ms`` is the age below which a TIME_WAIT
    socket counts in ``timewait_recent`` (its remaining timer is above
    ``60 s - recent_ms``). ``exclude`` holds llmdiag's own connections as
    ``(local port, remote port)`` (:mod:`llmdiag.collectors.own_sockets`): their
    sockets are left out, and so is the other end of such a connection when it is
    on this host too (same source and destination address: the engine's side of
    a scrape over loopback or the host's own address).

    IPv4 and IPv6 together (the default) are one request for both; a kernel that
    refuses that form is asked once per family."""
    mask = 0
    for name in states:
        mask |= 1 << TCP_STATES[name]
    young = TIMEWAIT_LEN_MS - recent_ms
    raw: dict[tuple[int, bytes, int], DestinationSockets] = {}
    families = tuple(families)
    both = set(families) == {socket.AF_INET, socket.AF_INET6}
    try:
        for family in (socket.AF_UNSPEC,) if both else families:
            _count(raw, _batches(family, mask), ephemeral, young, exclude)
    except SockDiagError:
        if not both:
            raise
        raw.clear()  # the older request form refused: one request per family
        for family in families:
            _count(raw, _batches(family, mask), ephemeral, young, exclude)
    out: dict[str, DestinationSockets] = {}
    for (fam, dst, dport), entry in raw.items():
        name = format_endpoint(fam, dst, dport)
        merged = out.get(name)
        if merged is None:
            out[name] = entry
        else:  # the same IPv4 peer seen natively and v4-mapped
            merged.timewait += entry.timewait
            merged.timewait_recent += entry.timewait_recent
            merged.other_ephemeral += entry.other_ephemeral
    return out


def _count(
    raw: dict[tuple[int, bytes, int], DestinationSockets],
    batches: Iterator[tuple[bytes, list[int]]],
    ephemeral: range | None,
    young: int,
    exclude: frozenset[tuple[int, int]],
) -> None:
    """Add the sockets of one dump to ``raw`` (per family, destination address and port).

    The hot loop of a busy host (thousands of TIME_WAIT sockets a tick): it reads only the
    fields it needs straight from the receive buffer instead of unpacking whole messages."""
    head = _MSG_HEAD.unpack_from
    timer = _EXPIRES.unpack_from
    for buf, bodies in batches:
        for b in bodies:
            fam, state, sport, dport = head(buf, b)
            width = 16 if fam == socket.AF_INET6 else 4
            dst = buf[b + 24 : b + 24 + width]
            if exclude and ((sport, dport) in exclude or ((dport, sport) in exclude and buf[b + 8 : b + 8 + width] == dst)):
                continue
            key = (fam, dst, dport)
            entry = raw.get(key)
            if entry is None:
                entry = raw[key] = DestinationSockets()
            if state == TIME_WAIT:
                entry.timewait += 1
                if timer(buf, b + 52)[0] > young:
                    entry.timewait_recent += 1
            elif ephemeral is not None and sport in ephemeral:
                entry.other_ephemeral += 1

"""Network namespaces of local processes, and the address that reaches each one from here.

A Kubernetes pod without ``hostNetwork`` has a network namespace of its own:
its listening sockets are not in the agent's ``/proc/net/tcp``, and an engine
bound to ``0.0.0.0`` in it answers on the *pod IP*, not on the node's
loopback. Everything needed to find both is readable from the node (with
``hostPID``), per process:

* ``/proc/PID/ns/net`` -> ``net:[INODE]``: which namespace the process is in
  (``readlink`` needs ptrace-read access, i.e. ``CAP_SYS_PTRACE`` for other
  users' processes). Processes are grouped by it so that each namespace's
  tables are read once, through any one of its processes.
* ``/proc/PID/net/tcp`` and ``tcp6``: the listening sockets of *that
  process's* namespace (``/proc/net`` is ``/proc/self/net``: the reader's).
* ``/proc/PID/net/fib_trie``: the namespace's IPv4 addresses are its
  ``/32 host LOCAL`` leaves (net/ipv4/fib_trie.c, ``fib_trie_seq_show``);
  loopback (127/8) is left out. The kernel has no other /proc file that
  lists IPv4 addresses (``ip addr`` uses netlink, which would need entering
  the namespace: ``setns`` and ``CAP_SYS_ADMIN``).
* ``/proc/PID/net/route``: which interface holds the default route, and the
  subnets on each interface, to rank the addresses when there are several
  (Multus secondary networks, SR-IOV/RDMA interfaces): see
  :func:`rank_ipv4`.
* ``/proc/PID/net/if_inet6`` and ``ipv6_route``: the IPv6 addresses, global
  scope only, on the default route's interface first.

Everything takes a ``proc_root`` so tests run on recorded trees; a missing
or garbled file gives fewer addresses, never an error.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "Inet6Address",
    "NamespaceAddresses",
    "NetnsScan",
    "Route",
    "namespace_of",
    "parse_fib_trie_local",
    "parse_if_inet6",
    "parse_ipv6_default_ifaces",
    "parse_route",
    "rank_ipv4",
    "rank_ipv6",
    "read_namespace_addresses",
    "scan_namespaces",
]

_RTF_UP = 0x0001  # include/uapi/linux/route.h
_RTF_REJECT = 0x0200  # the "unreachable" default routes ipv6_route lists on lo
# if_inet6 flags (include/uapi/linux/if_addr.h): an address still in DAD, failed DAD or deprecated
# is not one to reach the namespace at.
_IFA_F_DADFAILED = 0x08
_IFA_F_DEPRECATED = 0x20
_IFA_F_TENTATIVE = 0x40
_IPV6_SCOPE_GLOBAL = 0x00
_LINK_LOCAL_V4 = ipaddress.ip_network("169.254.0.0/16")


@dataclass(frozen=True, slots=True)
class Route:
    """One line of ``/proc/net/route`` (IPv4 main table)."""

    iface: str
    destination: int  # network-order address as an int (host-order hex decoded)
    mask: int
    flags: int
    metric: int

    @property
    def is_default(self) -> bool:
        return self.destination == 0 and self.mask == 0

    def contains(self, address: str) -> bool:
        try:
            value = int(ipaddress.IPv4Address(address))
        except ValueError:
            return False
        return (value & self.mask) == self.destination and self.mask != 0


@dataclass(frozen=True, slots=True)
class Inet6Address:
    """One line of ``/proc/net/if_inet6``."""

    address: str
    iface: str
    scope: int
    flags: int


@dataclass(frozen=True, slots=True)
class NamespaceAddresses:
    """A namespace's addresses that the node can reach, best first (empty: none known)."""

    ipv4: tuple[str, ...] = ()
    ipv6: tuple[str, ...] = ()


@dataclass
class NetnsScan:
    """Local processes grouped by network namespace.

    ``own`` is the reader's namespace (``proc_root/self/ns/net``), ``None`` when unreadable
    (a recorded tree without ``self``). ``groups`` maps each namespace id (``net:[INODE]``)
    to its pids in ascending order. ``unreadable`` counts the processes whose namespace
    link could not be read for want of permission (without ``CAP_SYS_PTRACE``).
    """

    own: str | None = None
    groups: dict[str, list[int]] = field(default_factory=dict)
    unreadable: int = 0


def namespace_of(proc_root: str | os.PathLike[str], pid: int | str) -> str | None:
    """``net:[INODE]`` of a process (``pid`` may be ``"self"``), or ``None`` when it cannot be read."""
    try:
        return os.readlink(os.path.join(proc_root, str(pid), "ns", "net"))
    except OSError:
        return None


def scan_namespaces(proc_root: str | os.PathLike[str] = "/proc") -> NetnsScan:
    """Group every pid under ``proc_root`` by the network namespace it is in (one ``readlink`` each)."""
    scan = NetnsScan(own=namespace_of(proc_root, "self"))
    try:
        pids = sorted(int(p.name) for p in Path(proc_root).iterdir() if p.name.isdigit())
    except OSError:
        return scan
    for pid in pids:
        try:
            ns = os.readlink(os.path.join(proc_root, str(pid), "ns", "net"))
        except PermissionError:
            scan.unreadable += 1
            continue
        except OSError:  # gone meanwhile, or a tree without ns/ links
            continue
        scan.groups.setdefault(ns, []).append(pid)
    return scan


# -- IPv4 --------------------------------------------------------------------


def parse_fib_trie_local(text: str) -> list[str]:
    """The IPv4 addresses of a namespace from ``/proc/PID/net/fib_trie``, loopback left out.

    The file prints each table (``Main:``, ``Local:``; with policy routing also
    numbered ones) as a trie: a leaf is ``|-- A.B.C.D`` followed by one line
    per prefix, ``/LEN SCOPE TYPE``. An address configured on an interface is a
    ``/32 host LOCAL`` leaf (the kernel adds it to the local table; since
    Linux 4.1 the main and local tables share one trie, so it is printed
    under both headings). Duplicates are dropped, first appearance kept.
    """
    found: list[str] = []
    leaf: str | None = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("|-- "):
            leaf = stripped[4:].strip()
            continue
        if not stripped.startswith("/") or leaf is None:
            leaf = None  # an inner node ("+-- prefix/len ..."), a table heading, or garbage
            continue
        parts = stripped.split()
        if len(parts) >= 3 and parts[0] == "/32" and parts[1] == "host" and parts[2] == "LOCAL":
            try:
                address = ipaddress.IPv4Address(leaf)
            except ValueError:
                continue
            if not address.is_loopback and str(address) not in found:
                found.append(str(address))
    return found


def _hex_ipv4(value: str) -> int:
    # /proc/net/route prints addresses as the host-order u32 in hex (little-endian on x86/arm64),
    # like /proc/net/tcp: turn it back into the address's numeric (network-order) value.
    return int.from_bytes(struct.pack("<I", int(value, 16)), "big")


def parse_route(text: str) -> list[Route]:
    """``/proc/PID/net/route`` lines that are up; garbled lines are skipped."""
    routes: list[Route] = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 8:
            continue
        try:
            flags = int(fields[3], 16)
            route = Route(fields[0], _hex_ipv4(fields[1]), _hex_ipv4(fields[7]), flags, int(fields[6]))
        except (ValueError, struct.error):
            continue
        if flags & _RTF_UP:
            routes.append(route)
    return routes


def rank_ipv4(addresses: list[str], routes: list[Route]) -> list[str]:
    """The addresses, the one the node most likely routes to first.

    Rank, then the order given:
      0. inside a subnet routed through the interface of the default route
         (the pod network's ``eth0`` with flannel, Cilium, most CNIs);
      1. inside no subnet routed through another interface: Calico and others
         give the pod a ``/32`` with no subnet route at all;
      2. inside a subnet of another interface (a Multus/SR-IOV secondary network);
      3. link-local ``169.254/16``.
    """
    defaults = sorted((r for r in routes if r.is_default), key=lambda r: r.metric)
    default_iface = defaults[0].iface if defaults else None

    def rank(address: str) -> int:
        if ipaddress.IPv4Address(address) in _LINK_LOCAL_V4:
            return 3
        subnets = [r for r in routes if not r.is_default and r.contains(address)]
        if default_iface is not None and any(r.iface == default_iface for r in subnets):
            return 0
        return 2 if subnets else 1

    return sorted(addresses, key=rank)  # sorted() is stable: the fib_trie order breaks ties


# -- IPv6 --------------------------------------------------------------------


def _hex_ipv6(value: str) -> str:
    # if_inet6 and ipv6_route print the 16 address bytes in network order, as 32 hex digits.
    return socket.inet_ntop(socket.AF_INET6, bytes.fromhex(value))


def parse_if_inet6(text: str) -> list[Inet6Address]:
    """``/proc/PID/net/if_inet6``: ``ADDRESS IFINDEX PREFIXLEN SCOPE FLAGS IFNAME`` per line (hex)."""
    out: list[Inet6Address] = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 6 or len(fields[0]) != 32:
            continue
        try:
            out.append(Inet6Address(_hex_ipv6(fields[0]), fields[5], int(fields[3], 16), int(fields[4], 16)))
        except (ValueError, OSError):
            continue
    return out


def parse_ipv6_default_ifaces(text: str) -> list[str]:
    """Interfaces of the IPv6 default routes in ``/proc/PID/net/ipv6_route``, lowest metric first.

    Lines: ``DEST DEST_LEN SRC SRC_LEN NEXT_HOP METRIC REFCNT USE FLAGS IFNAME``.
    The ``::/0`` reject routes the kernel keeps on ``lo`` are not defaults.
    """
    found: list[tuple[int, str]] = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 10:
            continue
        try:
            dest_len, metric, flags = int(fields[1], 16), int(fields[5], 16), int(fields[8], 16)
        except ValueError:
            continue
        if int(fields[0], 16) == 0 and dest_len == 0 and flags & _RTF_UP and not flags & _RTF_REJECT:
            found.append((metric, fields[9]))
    return [iface for _, iface in sorted(found)]


def rank_ipv6(addresses: list[Inet6Address], default_ifaces: list[str], ipv4_iface: str | None) -> list[str]:
    """Global, usable IPv6 addresses: on the IPv6 default route's interface first, then on the
    IPv4 default route's interface, then the rest, each in file order."""
    usable = [
        a for a in addresses
        if a.scope == _IPV6_SCOPE_GLOBAL and a.iface != "lo"
        and not a.flags & (_IFA_F_TENTATIVE | _IFA_F_DADFAILED | _IFA_F_DEPRECATED)
    ]
    preferred = default_ifaces[:1] + ([ipv4_iface] if ipv4_iface else [])

    def rank(a: Inet6Address) -> int:
        return preferred.index(a.iface) if a.iface in preferred else len(preferred)

    out: list[str] = []
    for a in sorted(usable, key=rank):
        if a.address not in out:
            out.append(a.address)
    return out


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="ascii", errors="replace")
    except OSError:
        return ""


def read_namespace_addresses(proc_root: str | os.PathLike[str], pid: int) -> NamespaceAddresses:
    """The addresses that reach the network namespace of ``pid`` from outside it, best first."""
    net = Path(proc_root) / str(pid) / "net"
    routes = parse_route(_read(net / "route"))
    ipv4 = rank_ipv4(parse_fib_trie_local(_read(net / "fib_trie")), routes)
    defaults = sorted((r for r in routes if r.is_default), key=lambda r: r.metric)
    ipv6 = rank_ipv6(
        parse_if_inet6(_read(net / "if_inet6")),
        parse_ipv6_default_ifaces(_read(net / "ipv6_route")),
        defaults[0].iface if defaults else None,
    )
    return NamespaceAddresses(tuple(ipv4), tuple(ipv6))

"""Find inference engines on this host from its listening TCP sockets.

1. Sockets in LISTEN state, with their local address, port and socket inode, in the
   agent's own network namespace (the node's, in a ``hostNetwork`` agent): from sock_diag
   on the live host (the kernel walks only its listening sockets), else (a recorded tree,
   or sock_diag refused) ``/proc/net/tcp`` and ``/proc/net/tcp6`` (``st`` ``0A``), which
   list every socket of the host, TIME_WAIT ones included. A wildcard listener there is
   probed on loopback.
2. Every other network namespace of a local process (a pod without
   ``hostNetwork``; see :mod:`llmdiag.collectors.netns`): processes are
   grouped by ``/proc/PID/ns/net``, and each namespace's
   ``/proc/PID/net/tcp`` and ``tcp6`` are read once, through one of its
   processes. A wildcard listener there is probed at the namespace's address
   (the pod IP, from ``/proc/PID/net/fib_trie``); one bound to loopback
   cannot be reached from outside its namespace, so it is not probed but
   reported (:attr:`Discovery.unreachable`, and a warning in the log).
   A namespace's tables are read again only when the sockets its processes
   hold change (:class:`_TableCache` says why).
3. ``/proc/PID/fd/*``: a link to ``socket:[INODE]`` names the process that
   owns each listening socket (needs root for other users' processes;
   without it ``pid`` stays ``None``). Socket inodes are unique across
   namespaces, so one pass over the processes serves all of them.
4. ``GET /metrics`` on each port (0.5 s): an answer with a known engine
   prefix (``vllm:``, ``sglang:``, ``trtllm_``, ``nv_trt_llm_``,
   ``nv_inference_``, ``tgi_``) is an engine; ``GET /v1/models`` (OpenAI
   servers) or the scrape's ``model_name``/``model`` labels give its models.

Everything hangs off one ``proc_root`` so tests can point it at a recorded
tree. :func:`discover_engines` is what the agent calls; :func:`discover`
also returns what could not be probed, for ``llmdiag doctor``.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from llmdiag.collectors.engine_names import ALL_PREFIXES, detect_dialect
from llmdiag.collectors.engine_parse import parse_exposition, read_engines
from llmdiag.collectors.http_fetch import PROMETHEUS_ACCEPT, FetchFunction, http_get
from llmdiag.collectors.netns import NamespaceAddresses, read_namespace_addresses, scan_namespaces
from llmdiag.collectors.sockdiag import SockDiagError, iter_listening
from llmdiag.model import Backend

__all__ = [
    "Discovery",
    "ListeningSocket",
    "UnreachableListener",
    "discover",
    "discover_engines",
    "established_sockets",
    "listening_sockets",
    "socket_owners",
]

log = logging.getLogger(__name__)

_LISTEN = "0A"  # TCP_LISTEN in include/net/tcp_states.h, as /proc/net/tcp prints it (hex)
_ESTABLISHED = "01"

#: Ports that speak something other than HTTP and would only waste a probe
#: (ssh, smtp, dns, rpcbind, nfs, mysql, postgres, redis, memcached, etcd).
NON_HTTP_PORTS = frozenset({22, 25, 53, 111, 2049, 3306, 5432, 6379, 11211, 2379, 2380})

_PROBE_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class ListeningSocket:
    host: str  # the local address as text ("0.0.0.0", "::", "127.0.0.1")
    port: int
    inode: int
    family: int  # socket.AF_INET or socket.AF_INET6


def _ipv4(hex_addr: str) -> str:
    # /proc/net/tcp prints the address as the host-order u32 in hex: little-endian on x86/arm64.
    return socket.inet_ntop(socket.AF_INET, struct.pack("<I", int(hex_addr, 16)))


def _ipv6(hex_addr: str) -> str:
    # Four host-order u32 words, each printed like an IPv4 address.
    words = [int(hex_addr[i : i + 8], 16) for i in range(0, 32, 8)]
    return socket.inet_ntop(socket.AF_INET6, struct.pack("<4I", *words))


def listening_sockets(proc_root: str | os.PathLike[str] = "/proc", pid: int | None = None) -> list[ListeningSocket]:
    """Every TCP socket in LISTEN state in the reader's network namespace, or in that of ``pid``;
    a missing or garbled table gives fewer sockets, not an error.

    The reader's own namespace on the live ``/proc`` comes from sock_diag
    (:func:`~llmdiag.collectors.sockdiag.iter_listening`); another root (a recorded tree), another
    process's namespace (sock_diag answers only for the reader's), or a failed sock_diag read the
    ``net/tcp`` files."""
    if pid is None and Path(proc_root) == Path("/proc"):
        try:
            return [ListeningSocket(socket.inet_ntop(family, addr), port, inode, family)
                    for family, addr, port, inode in iter_listening()]
        except (SockDiagError, OSError, ValueError) as exc:
            log.debug("sock_diag listing of listening sockets failed (%s): reading /proc/net/tcp", exc)
    net = Path(proc_root) / "net" if pid is None else Path(proc_root) / str(pid) / "net"
    return [sock for sock, _remote_port in _table_sockets(net, _LISTEN)]


def _table_sockets(net: Path, state: str) -> Iterator[tuple[ListeningSocket, int]]:
    """The sockets in ``state`` (its hex code) of ``net``'s ``tcp`` and ``tcp6`` tables: each by its
    local address, and its remote port."""
    for name, family, decode in (("tcp", socket.AF_INET, _ipv4), ("tcp6", socket.AF_INET6, _ipv6)):
        try:
            lines = (net / name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != state:
                continue
            try:
                addr, port_hex = fields[1].split(":")
                sock = ListeningSocket(decode(addr), int(port_hex, 16), int(fields[9]), family)
                remote_port = int(fields[2].rsplit(":", 1)[1], 16)
            except (ValueError, OSError, struct.error, IndexError):
                continue
            yield sock, remote_port


def established_sockets(pid: int, ports: Iterable[int],
                        proc_root: str | os.PathLike[str] = "/proc") -> list[tuple[ListeningSocket, int]]:
    """The ESTABLISHED TCP sockets on a local port in ``ports`` of the network namespace ``pid`` is
    in (``/proc/PID/net/tcp*``: sock_diag answers only for the reader's namespace): each by its
    local address, and its remote port; [] when the process is gone."""
    wanted = set(ports)
    return [(s, rport) for s, rport in _table_sockets(Path(proc_root) / str(pid) / "net", _ESTABLISHED)
            if s.port in wanted]


def socket_owners(inodes: Iterable[int], proc_root: str | os.PathLike[str] = "/proc",
                  likely: Iterable[int] = ()) -> dict[int, int]:
    """``{socket inode: pid}`` by reading ``/proc/PID/fd`` links; vanished or unreadable processes are skipped.

    ``likely`` pids (the owners found last time) are read first, in that order: when they
    still hold every inode, no other process is read. Reading every process's fd links is
    the expensive part (a ``readlink`` per descriptor on the host: ~20 ms of CPU for 16
    backends among ~120 processes), and a rescan usually finds the same owners."""
    wanted = {f"socket:[{inode}]": inode for inode in inodes}
    owners: dict[int, int] = {}
    if not wanted:
        return owners
    root = Path(proc_root)
    first = list(dict.fromkeys(likely))
    if _read_owners(root, first, wanted, owners):
        return owners
    try:
        pids = sorted(int(p.name) for p in root.iterdir() if p.name.isdigit())
    except OSError:
        return owners
    seen = set(first)
    _read_owners(root, [pid for pid in pids if pid not in seen], wanted, owners)
    return owners


def _read_owners(root: Path, pids: Iterable[int], wanted: dict[str, int], owners: dict[int, int]) -> bool:
    """Add the owners of ``wanted`` found among ``pids`` to ``owners``; True once all are found."""
    for pid in pids:
        if len(owners) == len(wanted):
            return True
        try:
            fds = os.scandir(root / str(pid) / "fd")
        except OSError:  # gone, or not ours to read without root
            continue
        with fds:
            for fd in fds:
                try:
                    target = os.readlink(fd.path)
                except OSError:
                    continue
                inode = wanted.get(target)
                if inode is not None and inode not in owners:
                    owners[inode] = pid
    return len(owners) == len(wanted)


_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1", "::ffff:127.0.0.1"})
_WILDCARD = frozenset({"0.0.0.0", "::", "::ffff:0.0.0.0"})

#: Words in a process's command line that make a loopback-only listener worth a warning: it may
#: well be an engine that nobody can reach. Other loopback listeners in pods (service-mesh admin
#: ports, debuggers) are only logged at debug level.
ENGINE_COMMAND_HINTS = (
    "vllm", "sglang", "python", "triton", "text-generation", "trtllm", "tensorrt", "lmdeploy", "llama", "llmdiag",
)


@dataclass(frozen=True, slots=True)
class UnreachableListener:
    """A listener in another network namespace that cannot be probed from here, and why."""

    netns: str  # "net:[INODE]"
    host: str
    port: int
    pid: int | None
    command: str  # the start of /proc/PID/cmdline, "" when unknown
    reason: str

    @property
    def likely_engine(self) -> bool:
        return any(hint in self.command.lower() for hint in ENGINE_COMMAND_HINTS)

    def describe(self) -> str:
        who = f"pid {self.pid}" + (f" ({self.command})" if self.command else "") if self.pid else "a process"
        return f"{who} in {self.netns} listens on {_hostport(self.host, self.port)}: {self.reason}"


@dataclass
class Discovery:
    """What :func:`discover` found: the engines, and what it could not look at."""

    backends: list[Backend] = field(default_factory=list)
    #: listeners in other namespaces that were not probed (loopback binds, no address)
    unreachable: list[UnreachableListener] = field(default_factory=list)
    #: network namespaces other than the agent's whose listening sockets were read
    namespaces: int = 0
    #: processes whose network namespace could not be read (no ``CAP_SYS_PTRACE``)
    unreadable_processes: int = 0


@dataclass(frozen=True, slots=True)
class _Target:
    sock: ListeningSocket
    hosts: tuple[str, ...]  # where to probe, in order: the first that answers as an engine wins
    netns: str | None  # None: the agent's own namespace


def _probe_host(sock: ListeningSocket) -> str:
    """Where to reach a listener in this namespace: wildcard binds answer on loopback."""
    if sock.host in _WILDCARD:
        return "127.0.0.1" if sock.family == socket.AF_INET else "::1"
    return sock.host


def _reach(sock: ListeningSocket, addresses: NamespaceAddresses) -> tuple[tuple[str, ...], str]:
    """Where a listener in *another* namespace answers from here: ``(hosts, "")``, or ``((), why not)``."""
    try:
        ip: ipaddress.IPv4Address | ipaddress.IPv6Address = ipaddress.ip_address(sock.host)
    except ValueError:
        return (), "an address that cannot be parsed"
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return (), "bound to loopback, which only its own network namespace reaches"
    if ip.is_unspecified:
        # A "::" socket takes IPv4 too unless IPV6_V6ONLY (net.ipv6.bindv6only is 0 by default,
        # and /proc/net/tcp6 does not show the flag): the IPv4 address first, then the IPv6 one.
        hosts = addresses.ipv4[:1] + (addresses.ipv6[:1] if sock.family == socket.AF_INET6 else ())
        if not hosts:
            return (), "its network namespace has no address the node can reach"
        return hosts, ""
    if ip.is_link_local:
        return (), "bound to a link-local address"
    return (str(ip),), ""


def _skipped(port: int, only: set[int] | None) -> bool:
    return port in NON_HTTP_PORTS or (only is not None and port not in only)


def _own_targets(sockets: list[ListeningSocket], only: set[int] | None) -> list[_Target]:
    by_port: dict[int, ListeningSocket] = {}
    for sock in sockets:
        if _skipped(sock.port, only):
            continue
        # One probe per port; prefer the IPv4 (or wildcard) listener of dual binds.
        if sock.port not in by_port or by_port[sock.port].family == socket.AF_INET6:
            by_port[sock.port] = sock
    return [_Target(s, (_probe_host(s),), None) for s in by_port.values()]


_Namespace = tuple[str, int, list[ListeningSocket]]  # netns id, the pid read for it, its listening sockets
_Choice = tuple[ListeningSocket, tuple[str, ...], str]  # a listener, where to probe it, why not (if nowhere)


@dataclass
class _ForeignScan:
    namespaces: list[_Namespace] = field(default_factory=list)
    unreadable: int = 0  # processes whose namespace link could not be read
    owners: dict[int, int] = field(default_factory=dict)  # socket inode -> pid, from the fd pass


def _held_sockets(proc_root: str | os.PathLike[str], pids: list[int]) -> dict[int, int] | None:
    """``{socket inode: pid}`` of every socket the processes hold, or ``None`` when one of them
    cannot be listed (no ``CAP_DAC_READ_SEARCH``/``CAP_SYS_PTRACE``): then a missing socket proves nothing."""
    held: dict[int, int] = {}
    for pid in pids:
        try:
            entries = os.scandir(os.path.join(proc_root, str(pid), "fd"))
        except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
            continue  # gone meanwhile
        except OSError:
            return None
        with entries:
            for fd in entries:
                try:
                    target = os.readlink(fd.path)
                except OSError:
                    continue
                if target.startswith("socket:[") and target.endswith("]"):
                    try:
                        held.setdefault(int(target[8:-1]), pid)
                    except ValueError:
                        continue
    return held


class _TableCache:
    """The listening sockets of each network namespace, with the socket inodes its processes held
    when the table was read.

    Why: ``/proc/PID/net/tcp`` and ``tcp6`` walk the kernel's *global* TCP hash tables and keep
    the namespace's entries, so each read costs the same whatever the namespace holds (5 ms on the
    development VM's 262,144-bucket table; the table grows with memory). Listing the processes'
    fds costs microseconds. A listening socket is held by some process's fd, so while the held
    inodes are the same no listener can have come or gone, and a namespace whose processes hold
    no socket at all (a pod that only makes outgoing calls, a pause process) has no listener.
    The one case this misses: a listening socket held only by a process of *another* namespace
    (created, then handed over an fd or kept across ``setns``), which no engine does.
    Entries of namespaces not seen in the last pass are dropped.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[str, str], tuple[frozenset[int], int, list[ListeningSocket]]] = {}
        self._lock = threading.Lock()
        self.reads = 0  # tables read, for tests and benchmarks

    def namespaces(self, proc_root: str | os.PathLike[str], own_inodes: set[int]) -> _ForeignScan:
        scan = scan_namespaces(proc_root)
        out = _ForeignScan(unreadable=scan.unreadable)
        root = str(proc_root)
        with self._lock:
            previous, kept = self._entries, {}
            for netns, pids in scan.groups.items():
                if netns == scan.own:
                    continue
                held = _held_sockets(proc_root, pids)
                if held is not None:
                    out.owners.update(held)
                    if not held:
                        continue
                    cached = previous.get((root, netns))
                    # (the pid read for it must still be there: its net/ files give the addresses)
                    if cached is not None and cached[0] == frozenset(held) and cached[1] in pids:
                        kept[(root, netns)] = cached
                        out.namespaces.append((netns, cached[1], cached[2]))
                        continue
                read = self._read(proc_root, pids, own_inodes)
                if read is None:
                    continue
                reader, sockets = read
                if held is not None:
                    kept[(root, netns)] = (frozenset(held), reader, sockets)
                out.namespaces.append((netns, reader, sockets))
            self._entries = kept
        return out

    def _read(self, proc_root: str | os.PathLike[str], pids: list[int], own_inodes: set[int]) -> tuple[int, list[ListeningSocket]] | None:
        for pid in pids:  # the first process whose table can still be read speaks for the namespace
            try:
                (Path(proc_root) / str(pid) / "net" / "tcp").open("rb").close()
            except OSError:
                continue
            self.reads += 1
            sockets = listening_sockets(proc_root, pid)
            # A socket inode is in exactly one namespace: seeing one of ours means this *is* our
            # namespace, seen through a tree without a readable `self` link.
            return None if any(s.inode in own_inodes for s in sockets) else (pid, sockets)
        return None


_TABLES = _TableCache()


def _better(sock: ListeningSocket, hosts: tuple[str, ...], current: _Choice | None) -> bool:
    """Per port, a reachable listener beats an unreachable one; then IPv4 beats IPv6, as on the node."""
    if current is None:
        return True
    if bool(hosts) != bool(current[1]):
        return bool(hosts)
    return current[0].family == socket.AF_INET6 and sock.family == socket.AF_INET


def _foreign_targets(
    proc_root: str | os.PathLike[str], only: set[int] | None, own_inodes: set[int], result: Discovery,
    owners: dict[int, int],
) -> tuple[list[_Target], list[tuple[ListeningSocket, str, str]]]:
    scan = _TABLES.namespaces(proc_root, own_inodes)
    result.unreadable_processes = scan.unreadable
    owners.update(scan.owners)
    targets: list[_Target] = []
    unreachable: list[tuple[ListeningSocket, str, str]] = []
    for netns, reader, sockets in scan.namespaces:
        result.namespaces += 1
        wanted = [s for s in sockets if not _skipped(s.port, only)]
        if not wanted:
            continue
        addresses = read_namespace_addresses(proc_root, reader)
        best: dict[int, _Choice] = {}
        for sock in wanted:
            hosts, reason = _reach(sock, addresses)
            if _better(sock, hosts, best.get(sock.port)):
                best[sock.port] = (sock, hosts, reason)
        for sock, hosts, reason in best.values():
            if hosts:
                targets.append(_Target(sock, hosts, netns))
            else:
                unreachable.append((sock, netns, reason))
    return targets, unreachable


def _command(proc_root: str | os.PathLike[str], pid: int | None) -> str:
    """The program and its first two arguments, absolute paths cut to their last part, for people
    (``python3 -m vllm.entrypoints.openai.api_server``, ``python3 llmdiag fake-engine``)."""
    if pid is None:
        return ""
    try:
        with open(os.path.join(proc_root, str(pid), "cmdline"), "rb") as f:
            argv = f.read(4096).split(b"\0")[:3]
    except OSError:
        return ""
    words = [a.decode("utf-8", "replace") for a in argv]
    return " ".join(os.path.basename(w) if w.startswith("/") else w for w in words if w)[:80]


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _url(host: str, port: int) -> str:
    return f"http://{_hostport(host, port)}"


def _probe(url: str, pid: int | None, timeout: float, fetch: FetchFunction) -> Backend | None:
    result = fetch(url + "/metrics", timeout, _PROBE_BYTES, PROMETHEUS_ACCEPT)
    if not result.ok:
        return None
    body = result.body
    # Cheap test before parsing: most listeners are not engines.
    if not any(p in body or p[:-1] + ":" in body for p in ALL_PREFIXES):
        return None
    parsed = parse_exposition(body)
    dialect = detect_dialect(parsed.names())
    if dialect is None:
        return None
    models = _openai_models(url, timeout, fetch) if dialect.engine != "triton" else ()
    if not models:
        models = read_engines(parsed, dialect).models
    return Backend.from_url(url, engine=dialect.engine, models=tuple(models), pid=pid)


def _openai_models(url: str, timeout: float, fetch: FetchFunction) -> tuple[str, ...]:
    result = fetch(url + "/v1/models", timeout, 1024 * 1024, "application/json")
    if not result.ok:
        return ()
    try:
        data = json.loads(result.body).get("data", [])
        return tuple(str(m["id"]) for m in data if isinstance(m, dict) and m.get("id"))
    except (ValueError, AttributeError, TypeError):
        return ()


def discover(
    proc_root: str | os.PathLike[str] = "/proc",
    timeout: float = 0.5,
    fetch: FetchFunction | None = None,
    ports: Iterable[int] | None = None,
    max_workers: int = 8,
    progress: Callable[[str], None] | None = None,
) -> Discovery:
    """Engines listening on this host, in the agent's network namespace and in every other
    namespace of a local process, sorted by port then URL; and the listeners that could not
    be probed. Never raises for an odd host: unreadable tables and unanswering ports just
    find fewer engines.

    ``ports`` limits the probe to those ports.
    """
    fetch = fetch or http_get
    only = set(ports) if ports is not None else None
    result = Discovery()
    own_sockets = listening_sockets(proc_root)
    own = _own_targets(own_sockets, only)
    own_inodes = {s.inode for s in own_sockets}
    owners: dict[int, int] = {}  # the fd pass over the pods' processes already names their owners
    try:
        foreign, unreachable = _foreign_targets(proc_root, only, own_inodes, result, owners)
    except Exception as exc:  # noqa: BLE001 - other namespaces are a bonus; the node's own ports stand alone
        log.warning("reading the network namespaces of local processes failed: %s", exc)
        foreign, unreachable = [], []
    candidates = sorted(own + foreign, key=lambda t: (t.sock.port, t.hosts))
    unowned = [i for i in [t.sock.inode for t in candidates] + [s.inode for s, _, _ in unreachable] if i not in owners]
    owners.update(socket_owners(unowned, proc_root))
    for sock, netns, reason in unreachable:
        pid = owners.get(sock.inode)
        command = _command(proc_root, pid)
        result.unreachable.append(UnreachableListener(netns, sock.host, sock.port, pid, command, reason))
    if not candidates:
        return result
    with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(candidates)))) as pool:
        futures = [pool.submit(_probe_target, t, owners.get(t.sock.inode), timeout, fetch) for t in candidates]
        for target, future in zip(candidates, futures, strict=True):
            try:
                backend = future.result()
            except Exception:  # noqa: BLE001 - a probe must not stop discovery
                backend = None
            if progress:
                where = f"port {target.sock.port}" if target.netns is None else \
                    f"{_hostport(target.hosts[0], target.sock.port)} ({target.netns})"
                progress(f"{where}: {backend.engine if backend else 'no engine'}")
            if backend is not None:
                result.backends.append(backend)
    result.backends.sort(key=lambda b: (b.port, b.url))
    return result


def _probe_target(target: _Target, pid: int | None, timeout: float, fetch: FetchFunction) -> Backend | None:
    for host in target.hosts:
        backend = _probe(_url(host, target.sock.port), pid, timeout, fetch)
        if backend is not None:
            return backend
    return None


#: (netns, port, pid) of the unreachable listeners already warned about: discovery runs again
#: every ``discover_interval_seconds``, and one warning per listener is enough.
_warned: set[tuple[str, int, int | None]] = set()


def discover_engines(
    proc_root: str | os.PathLike[str] = "/proc",
    timeout: float = 0.5,
    fetch: FetchFunction | None = None,
    ports: Iterable[int] | None = None,
    max_workers: int = 8,
    progress: Callable[[str], None] | None = None,
) -> list[Backend]:
    """The engines of :func:`discover`; each listener that could not be probed is logged once
    (at warning when its process looks like an engine, else at debug)."""
    result = discover(proc_root, timeout, fetch, ports, max_workers, progress)
    for listener in result.unreachable:
        key = (listener.netns, listener.port, listener.pid)
        if key in _warned:
            continue
        if len(_warned) > 4096:  # bounded: pods come and go for months
            _warned.clear()
        _warned.add(key)
        level = logging.WARNING if listener.likely_engine else logging.DEBUG
        log.log(level, "not probed for an engine: %s", listener.describe())
    if result.unreadable_processes:
        log.debug("%d processes' network namespaces could not be read (CAP_SYS_PTRACE)", result.unreadable_processes)
    return result.backends


def _same_ip(a: str, b: str) -> bool:
    try:
        return ipaddress.ip_address(a) == ipaddress.ip_address(b)
    except ValueError:
        return a == b


def local_backend_pids(backends: Iterable[Backend], proc_root: str | os.PathLike[str] = "/proc",
                       likely: Iterable[int] = ()) -> dict[str, int]:
    """Backend name -> pid of the local process listening on its port.

    ``Backend.pid`` wins where it is set. Otherwise a listener in the agent's namespace on the
    backend's port counts when its address is the backend's, or when the backend is addressed
    through loopback and the listener is on loopback or a wildcard address: for another address
    a wildcard listener may belong to a different host's engine, so it is not guessed at.
    A backend addressed at a pod IP (an address of another local network namespace) gets the
    process listening on that address or a wildcard one, on its port, in that namespace.
    Backends without a local listener are left out. ``likely``: pids to look at first
    (the last answer; see :func:`socket_owners`).
    """
    backends = list(backends)
    pids = {b.name: b.pid for b in backends if b.pid}
    unresolved = [b for b in backends if not b.pid]
    if not unresolved:
        return pids
    listening = listening_sockets(proc_root)
    wanted: dict[int, list[str]] = {}  # one listener may serve several backends (two addresses of a pod)
    for b in unresolved:
        for sock in listening:
            if sock.port == b.port and (sock.host == b.host or b.host in _LOOPBACK and sock.host in _LOOPBACK | _WILDCARD):
                wanted.setdefault(sock.inode, []).append(b.name)
                break
    found = {name for names in wanted.values() for name in names}
    elsewhere = [b for b in unresolved if b.name not in found and b.host not in _LOOPBACK]
    if elsewhere:
        try:
            _pod_listeners(proc_root, elsewhere, {s.inode for s in listening}, wanted)
        except Exception as exc:  # noqa: BLE001 - best effort, as for the node's own sockets
            log.warning("reading the network namespaces of local processes failed: %s", exc)
    for inode, pid in socket_owners(wanted, proc_root, likely).items():
        for name in wanted[inode]:
            pids[name] = pid
    return pids


def _pod_listeners(proc_root: str | os.PathLike[str], backends: list[Backend], own_inodes: set[int],
                   wanted: dict[int, list[str]]) -> None:
    """Add to ``wanted`` the listener of each backend addressed at another local namespace's address.

    The addresses are read first (cheap) and the TCP tables (a walk of the kernel's whole hash
    table each) only of a namespace that holds one of the backends' addresses: a backend on
    another host costs no table read.
    """
    scan = scan_namespaces(proc_root)
    for netns, pids in scan.groups.items():
        if netns == scan.own:
            continue
        reader = next((p for p in pids if (Path(proc_root) / str(p) / "net" / "fib_trie").exists()), None)
        if reader is None:
            continue
        addresses = read_namespace_addresses(proc_root, reader)
        here = [b for b in backends if any(_same_ip(b.host, a) for a in addresses.ipv4 + addresses.ipv6)]
        if not here:
            continue
        sockets = listening_sockets(proc_root, reader)
        if any(s.inode in own_inodes for s in sockets):
            continue  # our own namespace, seen through a tree without `self`
        for b in here:
            sock = next((s for s in sockets if s.port == b.port and (s.host in _WILDCARD or _same_ip(s.host, b.host))), None)
            if sock is not None:
                wanted.setdefault(sock.inode, []).append(b.name)

"""Find inference engines on this host from its listening TCP sockets.

1. Sockets in LISTEN state, with their local address, port and socket inode: from
   sock_diag on the live host (the kernel walks only its listening sockets), else (a
   recorded tree, or sock_diag refused) ``/proc/net/tcp`` and ``/proc/net/tcp6`` (``st``
   ``0A``), which list every socket of the host, TIME_WAIT ones included.
2. ``/proc/PID/fd/*``: a link to ``socket:[INODE]`` names the process that
   owns each listening socket (needs root for other users' processes;
   without it ``pid`` stays ``None``).
3. ``GET /metrics`` on each port (0.5 s): an answer with a known engine
   prefix (``vllm:``, ``sglang:``, ``trtllm_``, ``nv_trt_llm_``,
   ``nv_inference_``, ``tgi_``) is an engine; ``GET /v1/models`` (OpenAI
   servers) or the scrape's ``model_name``/``model`` labels give its models.

Everything hangs off one ``proc_root`` so tests can point it at a recorded
tree. :func:`discover_engines` is what ``llmdiag doctor`` and the agent call.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from llmdiag.collectors.engine_names import ALL_PREFIXES, detect_dialect
from llmdiag.collectors.engine_parse import parse_exposition, read_engines
from llmdiag.collectors.http_fetch import PROMETHEUS_ACCEPT, FetchFunction, http_get
from llmdiag.collectors.sockdiag import SockDiagError, iter_listening
from llmdiag.model import Backend

__all__ = ["ListeningSocket", "discover_engines", "listening_sockets", "socket_owners"]

log = logging.getLogger("llmdiag.collectors.discovery")

_LISTEN = "0A"  # TCP_LISTEN in include/net/tcp_states.h, as /proc/net/tcp prints it (hex)

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


def listening_sockets(proc_root: str | os.PathLike[str] = "/proc") -> list[ListeningSocket]:
    """Every TCP socket in LISTEN state; a missing or garbled table gives fewer sockets, not an error.

    With the live ``/proc``, from sock_diag (:func:`~llmdiag.collectors.sockdiag.iter_listening`);
    with another root (a recorded tree), or when sock_diag fails, from its ``net/tcp`` files."""
    if Path(proc_root) == Path("/proc"):
        try:
            return [ListeningSocket(socket.inet_ntop(family, addr), port, inode, family)
                    for family, addr, port, inode in iter_listening()]
        except (SockDiagError, OSError, ValueError) as exc:
            log.debug("sock_diag listing of listening sockets failed (%s): reading /proc/net/tcp", exc)
    out: list[ListeningSocket] = []
    for name, family, decode in (("tcp", socket.AF_INET, _ipv4), ("tcp6", socket.AF_INET6, _ipv6)):
        try:
            lines = (Path(proc_root) / "net" / name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != _LISTEN:
                continue
            try:
                addr, port_hex = fields[1].split(":")
                out.append(ListeningSocket(decode(addr), int(port_hex, 16), int(fields[9]), family))
            except (ValueError, OSError, struct.error):
                continue
    return out


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


def _probe_host(sock: ListeningSocket) -> str:
    """Where to reach a listener from this host: wildcard binds answer on loopback."""
    if sock.host in ("0.0.0.0", "::", "::ffff:0.0.0.0"):
        return "127.0.0.1" if sock.family == socket.AF_INET else "::1"
    return sock.host


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


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


def discover_engines(
    proc_root: str | os.PathLike[str] = "/proc",
    timeout: float = 0.5,
    fetch: FetchFunction | None = None,
    ports: Iterable[int] | None = None,
    max_workers: int = 8,
    progress: Callable[[str], None] | None = None,
) -> list[Backend]:
    """Engines listening on this host, sorted by port: engine kind, pid (when readable) and models.

    ``ports`` limits the probe to those ports. Never raises for an odd host:
    unreadable tables and unanswering ports just find fewer engines.
    """
    fetch = fetch or http_get
    only = set(ports) if ports is not None else None
    by_port: dict[int, ListeningSocket] = {}
    for sock in listening_sockets(proc_root):
        if sock.port in NON_HTTP_PORTS or (only is not None and sock.port not in only):
            continue
        # One probe per port; prefer the IPv4 (or wildcard) listener of dual binds.
        if sock.port not in by_port or by_port[sock.port].family == socket.AF_INET6:
            by_port[sock.port] = sock
    owners = socket_owners((s.inode for s in by_port.values()), proc_root)
    candidates = sorted(by_port.values(), key=lambda s: s.port)
    if not candidates:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(candidates)))) as pool:
        futures = [
            pool.submit(_probe, _url(_probe_host(s), s.port), owners.get(s.inode), timeout, fetch) for s in candidates
        ]
        found = []
        for sock, future in zip(candidates, futures, strict=True):
            try:
                backend = future.result()
            except Exception:  # noqa: BLE001 - a probe must not stop discovery
                backend = None
            if progress:
                progress(f"port {sock.port}: {backend.engine if backend else 'no engine'}")
            if backend is not None:
                found.append(backend)
    return found


_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1", "::ffff:127.0.0.1"})
_WILDCARD = frozenset({"0.0.0.0", "::"})


def local_backend_pids(backends: Iterable[Backend], proc_root: str | os.PathLike[str] = "/proc",
                       likely: Iterable[int] = ()) -> dict[str, int]:
    """Backend name -> pid of the local process listening on its port.

    ``Backend.pid`` wins where it is set. Otherwise a listener on the backend's port counts
    when its address is the backend's, or when the backend is addressed through loopback
    and the listener is on loopback or a wildcard address: for another address a wildcard
    listener may belong to a different host's engine, so it is not guessed at.
    Backends without a local listener are left out. ``likely``: pids to look at first
    (the last answer; see :func:`socket_owners`).
    """
    backends = list(backends)
    pids = {b.name: b.pid for b in backends if b.pid}
    unresolved = [b for b in backends if not b.pid]
    if not unresolved:
        return pids
    listening = listening_sockets(proc_root)
    wanted: dict[int, str] = {}
    for b in unresolved:
        for sock in listening:
            if sock.port == b.port and (sock.host == b.host or b.host in _LOOPBACK and sock.host in _LOOPBACK | _WILDCARD):
                wanted[sock.inode] = b.name
                break
    for inode, pid in socket_owners(wanted, proc_root).items():
        pids[wanted[inode]] = pid
    return pids


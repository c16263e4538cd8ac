"""``tcp`` collector: kernel TCP health per backend listen port and per remote ``ip:port``.

The BPF side is :file:`llmdiag/bpf/tcp_health.bpf.c` (structs in
``tcp_health.h``): it aggregates in maps and this collector reads them once
per tick; nothing is streamed per event. Two kinds of subject:

* **server side**, a backend's local listen port: samples under
  ``Scope.BACKEND`` (the backend's name). Engines in Kubernetes pods each
  listen on the same port (8000) in a network namespace of their own; when
  several backends share a port, a connection belongs to the one whose URL
  address is the address the client reached (the pod IP), and the rest of
  that port's traffic to a backend on a loopback URL (an engine in the node's
  namespace, reached at any of the node's addresses), else to nobody
  (``Scope.DESTINATION`` ``*:PORT``);
* **client side**, a remote ``ip:port`` that local clients (a gateway on this
  host) connect to: samples under ``Scope.DESTINATION``.

Signals (SPEC 3.2): ``tcp_send_bytes_total``, ``tcp_sends_total``,
``tcp_sndbuf_full_total`` (sends that returned ``-EAGAIN`` plus timed
blocking sends that waited at least ``send_block_seconds``),
``tcp_retransmits_total``, ``tcp_resets_sent_total``,
``tcp_resets_received_total``, ``tcp_connections_active``,
``tcp_connect_latency_seconds`` (client side; p50/p99 over the window),
``tcp_peer_closes_total``, ``tcp_active_closes_total`` (entries into
TIME_WAIT), ``srtt_seconds`` (mean of the sampled ``tcp_probe`` srtt since the
last tick, else the last sample). Extra: ``tcp_send_blocked_seconds_total``
(time inside send syscalls of the timed backend pids, with ``send_timing``). Host:
``tcp_mem_pressure_total{kind}`` (``sock_exceed_buf_limit``), and the BPF
health counters ``bpf_map_full_total{program=tcp_health}``,
``tcp_sock_common_mismatch_total``.

llmdiag's own connections (the engine collector's scrapes; see
:mod:`llmdiag.collectors.own_sockets`) are never counted: their ``(local port,
remote port)`` pairs go into the BPF ``own_conns`` map before they connect, and
the program leaves them out from either end.

Counters are ``_total`` since the program was loaded (cumulative map reads).
``tcp_connections_active`` is the count from a sock_diag dump at start (and, for a
backend in another network namespace, its process's ``/proc/PID/net/tcp*``) plus
the BPF delta since: connections opened before the agent are counted.

Attach points are chosen by feature probe: sends from ``sock_send_length``
(it carries the socket and the result; ``tcp:tcp_sendmsg_locked`` carries no
socket and so cannot be attributed), attached raw where the kernel allows it
(no perf record per send), else as a perf tracepoint, else kprobe
``tcp_sendmsg`` where kprobes exist. :meth:`TcpCollector.status` names the
path taken. Send timing (``[tcp] send_timing``) is off by default: it puts a
tracepoint on every send/write syscall of the host.
"""

from __future__ import annotations

import logging
import math
import socket
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from llmdiag.bpf import features
from llmdiag.bpf.loader import BPFUnavailable, Program, check_environment, program_tracepoints
from llmdiag.collectors.base import AttachNeed
from llmdiag.collectors.discovery import established_sockets
from llmdiag.collectors.histogram import histogram_quantiles
from llmdiag.collectors.netns import namespace_of
from llmdiag.collectors.own_sockets import OWN_PORTS, OwnPorts, Pair
from llmdiag.collectors.sample_reuse import SampleReuse
from llmdiag.collectors.sockdiag import SockDiagError, format_endpoint, iter_tcp
from llmdiag.collectors.timewait import backend_destination
from llmdiag.config.tcp import TcpConfig
from llmdiag.model import Backend, CollectorState, CollectorStatus, Distribution, Labelled, Sample, Scope

__all__ = ["TcpCollector", "attach_points", "build_tcp_collector", "send_path_defines", "slot_bounds_us"]

log = logging.getLogger("llmdiag.collectors.tcp")

ROLE_SERVER, ROLE_CLIENT = 1, 2
SIDE_SERVER, SIDE_CLIENT = 1, 2
# enum tcp_global in tcp_health.h
G_EXCEED_BUF_SEND, G_EXCEED_BUF_RECV, G_LAZY_FILLS, G_SOCK_COMMON_CHECKS, G_SOCK_COMMON_MISMATCH = range(5)

_EWMA_ALPHA = 0.2
_PID_REFRESH_SECONDS = 30.0

ProgramFactory = Callable[[str, Mapping[str, object]], Program]

def slot_bounds_us(slot: int) -> tuple[float, float]:
    """Bounds in microseconds of a connect latency histogram slot (``latency_slot()`` in the C file)."""
    if slot < 4:
        return float(slot), float(slot + 1)
    exp, sub = divmod(slot, 4)
    return float((4 + sub) << (exp - 2)), float((5 + sub) << (exp - 2))


def _tracepoint_format(category: str, event: str) -> str:
    root = features.tracefs_root()
    if root is None:
        return ""
    try:
        return (root / "events" / category / event / "format").read_text()
    except OSError:
        return ""


def send_path_defines() -> tuple[dict[str, int], str]:
    """Defines chosen by feature probe, and a description of the send path."""
    defines = {
        "HAVE_RETRANSMIT": int(features.tracepoint_exists("tcp", "tcp_retransmit_skb")),
        "HAVE_SEND_RESET": int(features.tracepoint_exists("tcp", "tcp_send_reset")),
        "HAVE_RECEIVE_RESET": int(features.tracepoint_exists("tcp", "tcp_receive_reset")),
        "HAVE_TCP_PROBE": int(features.tracepoint_exists("tcp", "tcp_probe")),
        "HAVE_EXCEED_BUF": int(features.tracepoint_exists("sock", "sock_exceed_buf_limit")),
    }
    if defines["HAVE_SEND_RESET"] and "enum sk_rst_reason" in _tracepoint_format("tcp", "tcp_send_reset"):
        headers = Path("/lib/modules") / __import__("os").uname().release / "build/include/net/rstreason.h"
        defines["DECLARE_SK_RST_REASON"] = int(not headers.exists())
    if features.tracepoint_exists("sock", "sock_send_length"):
        if _raw_tracepoints_supported():
            defines["SEND_PATH"] = 3
            return defines, "raw_tracepoint:sock_send_length"
        defines["SEND_PATH"] = 1
        return defines, "tracepoint:sock:sock_send_length"
    if features.kprobes_supported():
        defines["SEND_PATH"] = 2
        return defines, "kprobe:tcp_sendmsg"
    defines["SEND_PATH"] = 0
    return defines, "none"


def _raw_tracepoints_supported() -> bool:
    try:
        import warnings  # noqa: PLC0415

        from bcc import BPF  # noqa: PLC0415 - lazy: bcc is optional

        with warnings.catch_warnings():  # bcc passes str where it wants bytes
            warnings.simplefilter("ignore", DeprecationWarning)
            return bool(BPF.support_raw_tracepoint())
    except Exception:  # noqa: BLE001 - no bcc: the load fails later with the real reason
        return False


def _calibrate() -> None:
    """One loopback connection per address family right after load, so that
    inet_sock_set_state teaches the program the skc_prot of TCP sockets before
    the first send on a connection opened before the agent (see tcp_prots)."""
    for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        try:
            with socket.socket(family) as srv:
                srv.bind((host, 0))
                srv.listen(1)
                with socket.create_connection(srv.getsockname()[:2], timeout=1):
                    conn, _ = srv.accept()
                    conn.close()
        except OSError:
            continue  # no IPv6 on this host: IPv6 sockets are learned from real traffic


def _backend_endpoint(backend: Backend) -> tuple[str, bool]:
    """``(local "ip:port" as the kernel names it (timewait.backend_destination), whether the URL
    says "this host's own namespace": 127.0.0.1, ::1, localhost, or an unspecified address)``."""
    endpoint = backend_destination(backend)
    host = endpoint.rsplit(":", 1)[0].strip("[]")
    return endpoint, host in ("127.0.0.1", "::1", "0.0.0.0", "::")


def _find_listener_pids(ports: set[int]) -> set[int]:
    """Processes listening on ``ports`` (their sends are the ones worth timing)."""
    if not ports:
        return set()
    try:
        import psutil  # noqa: PLC0415 - only needed when send timing is on
    except ImportError:
        return set()
    pids: set[int] = set()
    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port in ports and conn.pid:
                pids.add(conn.pid)
    except (psutil.Error, OSError) as exc:
        log.warning("cannot list listening sockets to find backend pids: %s", exc)
    return pids


class TcpCollector:
    """``tcp`` collector (see the module docstring). ``program_factory`` is
    injectable so tests can deny the load; ``clock`` feeds the windows."""

    name = "tcp"

    def __init__(
        self,
        config: TcpConfig | None = None,
        backends: Iterable[Backend] = (),
        *,
        program_factory: ProgramFactory | None = None,
        clock: Callable[[], float] = time.monotonic,
        pid_finder: Callable[[set[int]], set[int]] = _find_listener_pids,
        own_connections: OwnPorts = OWN_PORTS,
    ) -> None:
        self.config = config or TcpConfig()
        self.own_connections = own_connections
        self._unsubscribe_own: Callable[[], None] | None = None
        self.backends = list(backends)
        self.clock = clock
        self.pid_finder = pid_finder
        self.server_ports: dict[int, list[str]] = {}
        for backend in self.backends:
            self.server_ports.setdefault(backend.port, []).append(backend.name)
        for port in self.config.server_ports:
            self.server_ports.setdefault(port, [])
        self.client_ports = {b.port for b in self.backends} | set(self.config.client_ports)
        # Server subjects: a port's number while at most one backend listens on it; for a port that
        # several share, the local "ip:port" of a backend's URL, and "*:PORT" for the rest.
        self._shared_ports: dict[int, tuple[dict[str, str], str]] = {}  # port -> (local "ip:port" -> subject, the rest's)
        self._server_names: dict[str, list[str]] = {}  # server subject -> backend names
        self._server_subjects: set[str] = set()  # watched: they read zeros before their first event
        self._map_server_subjects()
        self.program: Program | None = None
        self.unavailable: BPFUnavailable | None = None
        self.send_path = "none"
        self._problems: list[str] = []  # found at start, kept
        self._tick_problems: list[str] = []  # found by the last collect()
        self._last_ok_ts: float | None = None
        self._baseline: dict[tuple[int, str], int] = {}
        self._hist_history: deque[tuple[float, dict[tuple[int, str], dict[int, int]]]] = deque()
        self._ewma: dict[tuple[int, str], float] = {}
        self._prev_connect: dict[tuple[int, str], tuple[int, int]] = {}
        self._prev_srtt: dict[tuple[int, str], tuple[int, int]] = {}
        self._last_closes: dict[str, int] | None = None
        self._reuse = SampleReuse()
        # subject -> (current, oldest) histogram readings of its last window and (total, quantiles):
        # an idle endpoint's window repeats tick after tick (the readings are shared, not copied).
        self._window_quantiles: dict[tuple[int, str], tuple[Mapping[int, int], Mapping[int, int], int, Any]] = {}
        # Completed connects in all of ``stats`` at the last two reads (see _connect_hist).
        self._connects_seen: deque[int] = deque(maxlen=2)
        self.hist_reads_total = 0  # connect_hist map reads (the tests read it)
        self._timed_pids: set[int] = set()
        self._pids_refreshed = -math.inf
        self._start(program_factory or Program.load)

    def _map_server_subjects(self) -> None:
        by_port: dict[int, list[Backend]] = {}
        for backend in self.backends:
            by_port.setdefault(backend.port, []).append(backend)
        for port, names in self.server_ports.items():
            sharers = by_port.get(port, [])
            if len(sharers) <= 1:
                self._server_names[str(port)] = names
                self._server_subjects.add(str(port))
                continue
            owners: dict[str, str] = {}
            rest = None
            for backend in sharers:
                endpoint, node_local = _backend_endpoint(backend)
                owners[endpoint] = endpoint
                self._server_names.setdefault(endpoint, []).append(backend.name)
                self._server_subjects.add(endpoint)
                if node_local and rest is None:
                    # An engine in the node's namespace is reached at 127.0.0.1 and at every address
                    # of the node: the port's traffic at addresses no other backend has is its.
                    rest = endpoint
            self._shared_ports[port] = (owners, rest or f"*:{port}")

    def _server_subject(self, port: int, local: str) -> str:
        shared = self._shared_ports.get(port)
        if shared is None:
            return str(port)
        owners, rest = shared
        return owners.get(local, rest)

    # -- start ------------------------------------------------------------------
    def _start(self, factory: ProgramFactory) -> None:
        if factory is Program.load:
            try:
                # First, so a user without root or CAP_BPF hears that (with the way out), not a
                # PermissionError from the feature probes below.
                check_environment()
            except BPFUnavailable as exc:
                self.unavailable = exc
                log.warning("tcp collector unavailable: %s", exc)
                return
        defines, self.send_path = send_path_defines()
        defines.update({
            "SEND_TIMING": int(self.config.send_timing),
            "SEND_BLOCK_NS": int(self.config.send_block_seconds * 1e9),
            "SRTT_SAMPLE_MASK": self.config.srtt_sample_every - 1,
            "MAX_SOCKS": self.config.max_sockets,
            "MAX_ENDPOINTS": self.config.max_endpoints,
            "MAX_PORTS": 1024,
        })
        self.defines = defines
        program = None
        try:
            program = factory("tcp_health", defines)
            if defines["SEND_PATH"] == 2:  # kprobes are not auto-attached: the C names avoid bcc's kprobe__ prefix
                program.attach_kprobe("tcp_sendmsg", "on_tcp_sendmsg")
                program.attach_kretprobe("tcp_sendmsg", "on_tcp_sendmsg_ret")
            ports = program.table("ports")
            for port in set(self.server_ports) | self.client_ports:
                role = (ROLE_SERVER if port in self.server_ports else 0) | (ROLE_CLIENT if port in self.client_ports else 0)
                ports[ports.Key(port)] = ports.Leaf(role)
        except BPFUnavailable as exc:
            self.unavailable = exc
            log.warning("tcp collector unavailable: %s", exc)
        except Exception as exc:  # noqa: BLE001 - a bcc table error is a load failure too
            self.unavailable = BPFUnavailable(f"setting up tcp_health maps failed: {exc}", "see `llmdiag doctor`")
        if self.unavailable is not None:
            # Loaded but not usable (an attach or a map write failed): detach now, so a collector
            # that says "unavailable" costs the kernel nothing.
            if program is not None:
                program.close()
            return
        self.program = program
        self._unsubscribe_own = self.own_connections.subscribe(self._own_connection_changed)
        _calibrate()
        self._hist_history.append((self.clock(), {}))  # the window starts empty at load
        self._baseline = self._established_now()
        self._refresh_pids(self.clock())

    def _own_connection_changed(self, pair: Pair, added: bool) -> None:
        """Keep the BPF ``own_conns`` map in step with llmdiag's own connections (called from
        the thread that opens one, before it connects)."""
        program = self.program
        if program is None or program.closed:
            return
        try:
            table = program.table("own_conns")
            key = table.Key((pair[0] << 16) | pair[1])
            if added:
                table[key] = table.Leaf(1)
            else:
                del table[key]
        except Exception as exc:  # noqa: BLE001 - a full map or a closed program: the scrape is merely counted
            log.debug("own_conns update for %s failed: %s", pair, exc)

    def _established_now(self) -> dict[tuple[int, str], int]:
        """ESTABLISHED connections per subject key at start (sock_diag), the base of the active gauge."""
        counts: dict[tuple[int, str], int] = {}
        own = self.own_connections.pairs()
        try:
            for _state, lport, remote, local in iter_tcp(("ESTABLISHED",)):
                rport = int(remote.rsplit(":", 1)[1])
                if (lport, rport) in own or (rport, lport) in own:
                    continue  # llmdiag's own scrape
                if lport in self.server_ports:
                    key = (SIDE_SERVER, self._server_subject(lport, local))
                else:
                    if rport not in self.client_ports:
                        continue
                    key = (SIDE_CLIENT, remote)
                counts[key] = counts.get(key, 0) + 1
        except (SockDiagError, OSError) as exc:
            self._problems.append(f"no start count of open connections: {exc}")
        self._established_in_pods(counts, own)
        return counts

    def _established_in_pods(self, counts: dict[tuple[int, str], int], own_pairs: frozenset[Pair]) -> None:
        """Add the server-side connections of backends in other network namespaces (pod engines),
        which the sock_diag dump (the agent's namespace only) does not see: read through each
        backend's process, once per namespace (``/proc/PID/net/tcp*``)."""
        own_netns = namespace_of("/proc", "self")
        done: set[str] = set()
        for backend in self.backends:
            if not backend.pid or backend.port not in self.server_ports:
                continue
            netns = namespace_of("/proc", backend.pid)
            if netns is None or netns == own_netns or netns in done:
                continue
            done.add(netns)
            for sock, rport in established_sockets(backend.pid, self.server_ports):
                if (rport, sock.port) in own_pairs:
                    continue  # llmdiag's own scrape, seen from the engine's end
                local = format_endpoint(sock.family, socket.inet_pton(sock.family, sock.host), sock.port)
                key = (SIDE_SERVER, self._server_subject(sock.port, local))
                counts[key] = counts.get(key, 0) + 1

    def _refresh_pids(self, now: float) -> None:
        if self.program is None or not self.config.send_timing:
            return
        if now - self._pids_refreshed < _PID_REFRESH_SECONDS:
            return
        self._pids_refreshed = now
        wanted = {b.pid for b in self.backends if b.pid} | set(self.config.timed_pids)
        wanted |= self.pid_finder(set(self.server_ports))
        if wanted == self._timed_pids:
            return
        table = self.program.table("timed_pids")
        for pid in self._timed_pids - wanted:
            try:
                del table[table.Key(pid)]
            except KeyError:
                pass
        for pid in wanted - self._timed_pids:
            table[table.Key(pid)] = table.Leaf(1)
        self._timed_pids = wanted

    # -- reading ------------------------------------------------------------------
    def _subject_key(self, key: Mapping[str, Any]) -> tuple[int, str]:
        port = key["port"]
        if key["side"] == SIDE_SERVER and port not in self._shared_ports:
            return SIDE_SERVER, str(port)
        family = socket.AF_INET6 if key["family"] == 10 else socket.AF_INET
        endpoint = format_endpoint(family, key["addr"], port)
        if key["side"] == SIDE_SERVER:
            return SIDE_SERVER, self._server_subject(port, endpoint)
        return SIDE_CLIENT, endpoint

    def _read_stats(self) -> dict[tuple[int, str], dict[str, int]]:
        assert self.program is not None
        merged: dict[tuple[int, str], dict[str, int]] = {}
        for key, value in self.program.read_hash("stats", shared=True):
            subject = self._subject_key(key)
            slot = merged.setdefault(subject, dict.fromkeys(value, 0))
            for field, number in value.items():
                slot[field] += number
        return merged

    def _read_hist(self) -> dict[tuple[int, str], dict[int, int]]:
        assert self.program is not None
        out: dict[tuple[int, str], dict[int, int]] = {}
        for key, count in self.program.read_hash("connect_hist", shared=True):
            buckets = out.setdefault(self._subject_key(key["ep"]), {})
            buckets[key["slot"]] = buckets.get(key["slot"], 0) + count
        return out

    def _connect_hist(self, stats: Mapping[tuple[int, str], Mapping[str, int]]) -> dict[tuple[int, str], dict[int, int]]:
        """``connect_hist`` as of now, read only when it can have changed.

        The program adds to ``connect_hist`` only right after it counts the connect in ``stats``
        (``connects``), and nothing else writes to it. So while the total of completed connects is
        the same at this read and the two before, the last reading still holds and the map (one
        entry per endpoint and latency slot, hundreds of them) is not read again. Two reads, not
        one: a connect counted in ``stats`` just before one tick's read may reach ``connect_hist``
        just after that tick's histogram read; the next tick reads it again."""
        connects = sum(v.get("connects", 0) for v in stats.values())
        unchanged = len(self._connects_seen) == 2 and all(seen == connects for seen in self._connects_seen)
        self._connects_seen.append(connects)
        if unchanged and len(self._hist_history) > 0:
            return self._hist_history[-1][1]  # not changed in place by anyone: shared
        self.hist_reads_total += 1
        return self._read_hist()

    def active_closes_by_destination(self) -> dict[str, int] | None:
        """Cumulative active closes per client-side ``ip:port`` (as of the last collect)."""
        if self.program is None or self.program.closed:
            return None
        return dict(self._last_closes) if self._last_closes is not None else None

    def _connect_distribution(self, subject: tuple[int, str], now: float, stats: Mapping[str, int]) -> Distribution:
        current = self._hist_history[-1][1].get(subject, {})
        oldest = self._hist_history[0][1].get(subject, {})
        cached = self._window_quantiles.get(subject)
        if cached is not None and cached[0] == current and cached[1] == oldest:
            total, quantiles = cached[2], cached[3]  # the same window as last tick: the same quantiles
        else:
            total, quantiles = self._window(current, oldest)
            self._window_quantiles[subject] = (current, oldest, total, quantiles)
        connects, connect_ns = stats.get("connects", 0), stats.get("connect_ns", 0)
        prev = self._prev_connect.get(subject, (0, 0))
        self._prev_connect[subject] = (connects, connect_ns)
        if connects > prev[0]:
            mean = (connect_ns - prev[1]) / (connects - prev[0]) / 1e9
            old = self._ewma.get(subject)
            self._ewma[subject] = mean if old is None else _EWMA_ALPHA * mean + (1 - _EWMA_ALPHA) * old
        if not total:
            return Distribution(None, None, self._ewma.get(subject), 0)
        return Distribution(*quantiles, self._ewma.get(subject), total)

    @staticmethod
    def _window(current: Mapping[int, int], oldest: Mapping[int, int]) -> tuple[int, Any]:
        """Connects in the window (``current - oldest`` per slot) and their p50/p99 (None if none)."""
        window = {slot: count - oldest.get(slot, 0) for slot, count in current.items() if count - oldest.get(slot, 0) > 0}
        total = sum(window.values())
        if not total:
            return total, None
        buckets: list[tuple[float, float]] = []
        running = 0
        for slot in sorted(window):
            running += window[slot]
            buckets.append((slot_bounds_us(slot)[1] / 1e6, float(running)))
        buckets.append((math.inf, float(running)))
        return total, histogram_quantiles((0.5, 0.99), buckets)

    def collect(self, now: float) -> list[Sample]:
        if self.program is None:
            return []
        self.own_connections.pairs()  # forgets closed connections past their linger (and drops them from the map)
        self._tick_problems = []
        tick = self.clock()
        self._refresh_pids(tick)
        stats = self._read_stats()
        self._hist_history.append((tick, self._connect_hist(stats)))
        while len(self._hist_history) > 2 and tick - self._hist_history[1][0] >= self.config.connect_latency_window_seconds:
            self._hist_history.popleft()
        self._last_closes = {
            subject: values["active_closes"] for (side, subject), values in stats.items() if side == SIDE_CLIENT
        }
        # Backends' server ports are watched: a port with no events yet has real zeros.
        for name in self._server_subjects:
            stats.setdefault((SIDE_SERVER, name), {})
        for key in self._baseline:
            stats.setdefault(key, {})

        samples: list[Sample] = []
        for subject, values in sorted(stats.items()):
            signals = self._signals(subject, values, now)
            subjects = tuple(self._subjects(subject))
            # An idle endpoint's signals repeat tick after tick: its samples are built once.
            samples.extend(self._reuse.each(subjects, signals))
        self._reuse.next_tick()
        samples.extend(self._host_samples())
        self._last_ok_ts = now
        return samples

    def _subjects(self, subject: tuple[int, str]) -> list[tuple[Scope, str]]:
        side, name = subject
        if side == SIDE_CLIENT:
            return [(Scope.DESTINATION, name)]
        names = self._server_names.get(name, [])
        return [(Scope.BACKEND, b) for b in names] or [(Scope.DESTINATION, name if name[0] == "*" else f"*:{name}")]

    def _signals(self, subject: tuple[int, str], v: Mapping[str, int], now: float) -> dict[str, Any]:
        get = v.get
        signals: dict[str, Any] = {
            "tcp_send_bytes_total": get("send_bytes", 0),
            "tcp_sends_total": get("sends", 0),
            "tcp_sndbuf_full_total": get("send_eagain", 0) + get("send_blocked", 0),
            "tcp_retransmits_total": get("retransmits", 0),
            "tcp_resets_sent_total": get("resets_sent", 0),
            "tcp_resets_received_total": get("resets_received", 0),
            "tcp_connections_active": max(0, self._baseline.get(subject, 0) + get("established", 0)),
            "tcp_peer_closes_total": get("peer_closes", 0),
            "tcp_active_closes_total": get("active_closes", 0),
        }
        if self.send_path == "none":
            for name in ("tcp_send_bytes_total", "tcp_sends_total", "tcp_sndbuf_full_total"):
                signals[name] = None  # NA: no attach point for sends on this kernel
        if self.config.send_timing:
            signals["tcp_send_blocked_seconds_total"] = get("send_block_ns", 0) / 1e9
        if subject[0] == SIDE_CLIENT:
            signals["tcp_connect_latency_seconds"] = self._connect_distribution(subject, now, v)
        srtt_sum, srtt_n = get("srtt_us_sum", 0), get("srtt_samples", 0)
        prev_sum, prev_n = self._prev_srtt.get(subject, (0, 0))
        self._prev_srtt[subject] = (srtt_sum, srtt_n)
        if srtt_n > prev_n:
            signals["srtt_seconds"] = (srtt_sum - prev_sum) / (srtt_n - prev_n) / 1e6
        elif srtt_n:
            signals["srtt_seconds"] = get("srtt_us_last", 0) / 1e6
        return signals

    def _host_samples(self) -> list[Sample]:
        assert self.program is not None
        out: list[Sample] = []
        try:
            g = self.program.read_array("globals")
        except Exception as exc:  # noqa: BLE001
            self._tick_problems.append(f"cannot read globals: {exc}")
            return out
        pressure = Labelled()
        pressure.add(g[G_EXCEED_BUF_SEND], kind="send")
        pressure.add(g[G_EXCEED_BUF_RECV], kind="recv")
        out.append(Sample(Scope.HOST, "", "tcp_mem_pressure_total", pressure))
        out.append(Sample(Scope.HOST, "", "tcp_sock_common_mismatch_total", g[G_SOCK_COMMON_MISMATCH]))
        errors = self.program.errors()
        full = Labelled()
        full.add(errors.get("map_full", 0), program="tcp_health")
        out.append(Sample(Scope.HOST, "", "bpf_map_full_total", full))
        return out

    def globals(self) -> dict[str, int]:
        """The program's global counters by name (lazy fills, sock_common checks...)."""
        if self.program is None:
            return {}
        g = self.program.read_array("globals")
        return {"exceed_buf_send": g[G_EXCEED_BUF_SEND], "exceed_buf_recv": g[G_EXCEED_BUF_RECV],
                "lazy_fills": g[G_LAZY_FILLS], "sock_common_checks": g[G_SOCK_COMMON_CHECKS],
                "sock_common_mismatch": g[G_SOCK_COMMON_MISMATCH]}

    # -- contract -------------------------------------------------------------------
    def status(self) -> CollectorStatus:
        if self.unavailable is not None:
            reason = self.unavailable.reason + (f" (hint: {self.unavailable.hint})" if self.unavailable.hint else "")
            return CollectorStatus(CollectorState.UNAVAILABLE, reason, None)
        problems = self._problems + self._tick_problems
        if self.send_path == "none":
            problems.append("no attach point for sends (no sock:sock_send_length, no kprobes): send signals are NA")
        if self.program is not None and not self.program.closed:
            errors = self.program.errors()
            if errors.get("map_full"):
                problems.append(f"{errors['map_full']} BPF map updates failed (map full): raise tcp.max_sockets")
        if problems:
            return CollectorStatus(CollectorState.DEGRADED, "; ".join(problems), self._last_ok_ts)
        return CollectorStatus(CollectorState.OK, f"sends via {self.send_path}", self._last_ok_ts)

    def close(self) -> None:
        if self._unsubscribe_own is not None:
            self._unsubscribe_own()
            self._unsubscribe_own = None
        if self.program is not None:
            self.program.close()


#: What each tracepoint of tcp_health.bpf.c is for; inet_sock_set_state is the one the collector needs.
_PURPOSES = {
    ("sock", "inet_sock_set_state"): ("connections, closes, TIME_WAIT entries, connect latency", True),
    ("sock", "sock_send_length"): ("bytes and sends per socket (else kprobe tcp_sendmsg)", False),
    ("raw", "sock_send_length"): ("the same sends without a perf record each (faster)", False),
    ("tcp", "tcp_retransmit_skb"): ("retransmits", False),
    ("tcp", "tcp_send_reset"): ("resets sent", False),
    ("tcp", "tcp_receive_reset"): ("resets received", False),
    ("tcp", "tcp_probe"): ("sampled srtt", False),
    ("sock", "sock_exceed_buf_limit"): ("socket memory pressure", False),
}


def attach_points() -> list[AttachNeed]:
    """The attach points of the tcp collector, read from its BPF program (``llmdiag doctor``)."""
    out = []
    for category, event in program_tracepoints("tcp_health"):
        if category == "syscalls":
            purpose, required = "time spent in sends ([tcp] send_timing, off by default)", False
        else:
            purpose, required = _PURPOSES.get((category, event), ("", False))
        kind = "raw_tracepoint" if category == "raw" else "tracepoint"
        target = event if category == "raw" else f"{category}:{event}"
        out.append(AttachNeed("tcp", kind, target, purpose, required))
    out.append(AttachNeed("tcp", "kprobe", "tcp_sendmsg", "sends on kernels without sock:sock_send_length", False))
    return out


def build_tcp_collector(config: Any, backends: list[Backend]) -> TcpCollector:
    """Factory for the agent (``llmdiag.agent.wiring``): ``config`` is the root Config.
    Check :attr:`TcpCollector.unavailable` for a failed BPF load."""
    return TcpCollector(config.tcp, backends)

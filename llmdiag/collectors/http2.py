"""http2 collector: HTTP/2 and gRPC stream signals of local backends (SPEC 3.2, 4 "http2").

The ``http2_frames`` BPF program (llmdiag/bpf/http2_frames.bpf.c) walks the
HTTP/2 frame headers that the backend processes read from and write to their
accepted TCP connections, in the kernel, from syscall tracepoints. This
module finds those processes and connections in /proc (the pid owning the
LISTEN socket of each backend's port; see :mod:`h2_procnet`), keeps the
program's maps in step once per :attr:`Http2Config.refresh_seconds`, and
turns its cumulative counters into per-backend samples
(``Sample(Scope.BACKEND, backend.name, ...)``):

=============================== ==================================================================
``h2_streams_opened_total``      HEADERS received that opened a new client stream
``h2_streams_closed_total``      streams that reached "closed" (END_STREAM both ways, or RST_STREAM)
``h2_rst_stream_total``          Labelled ``code=<RFC 9113 name>,direction=received|sent``
``h2_goaway_total``              Labelled ``code=...,direction=...``
``h2_flow_control_stalls_total`` send windows exhausted >= ``stall_seconds`` (docs/http2.md)
``grpc_connections``             traced connections confirmed to speak HTTP/2 (gauge)
``h2_window_update_total``       Labelled ``direction=...``
``h2_settings_total``            Labelled ``direction=...``
``h2_send_eagain_total``         sends on HTTP/2 connections that returned EAGAIN
``h2_parse_resyncs_total``       times the walker lost its place (invalid header, too many frames)
``h2_stall_then_reset_total``    RST_STREAM/GOAWAY frames (either direction) on a connection where a
                                 flow-control stall ended at most ``stall_reset_window_seconds``
                                 before (or the reset stream itself was stalled): the per-connection
                                 join behind the ``grpc_flow_control_stall`` diagnosis
=============================== ==================================================================

A backend in a network namespace of its own (a Kubernetes pod engine; its
sockets are not in the agent's ``/proc/net/tcp``) is traced through its
process, found by discovery's :func:`~llmdiag.collectors.discovery.local_backend_pids`
at the backend's address: pod engines that all listen on the same port are
counted apart.

Directions are the backend's: ``received`` = the client sent it. Counters are
cumulative since the program loaded. A backend whose port no local process
has listened on since then gets no samples (and the status says so); one
that stopped listening keeps reporting its counters.

:meth:`Http2Collector.recent_events` gives the RST_STREAM/GOAWAY events with
their connection (pid, fd), timestamp and the connection's stall count at
that moment: the input for the ``grpc_flow_control_stall`` correlation.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from llmdiag.bpf.loader import BPFUnavailable, program_tracepoints
from llmdiag.collectors.base import AttachNeed
from llmdiag.collectors.h2_kernel import ConnectionCounters, H2Kernel, RawEvent, code_counts, code_name
from llmdiag.collectors.discovery import listening_sockets, local_backend_pids
from llmdiag.collectors.h2_procnet import BackendSockets, backend_sockets, pid_sockets
from llmdiag.collectors.netns import namespace_of
from llmdiag.config import Config
from llmdiag.config.http2 import Http2Config
from llmdiag.model import Backend, CollectorState, CollectorStatus, Labelled, Sample, Scope, label_key

__all__ = ["H2Event", "Http2Collector", "build_http2_collector"]

log = logging.getLogger("llmdiag.collectors.http2")

#: How often backends with no listener in the agent's namespace are looked for in other namespaces
#: (reading every namespace's addresses is too much for every refresh).
POD_LOOKUP_SECONDS = 10.0
#: How often the connection tables are read when no listener changed (see Http2Collector.refresh).
TABLES_SECONDS = 10.0


@dataclass(frozen=True, slots=True)
class H2Event:
    """One RST_STREAM or GOAWAY frame seen on a backend connection."""

    ts: float  # wall-clock seconds
    backend: str
    pid: int
    fd: int
    port: int  # the backend's port
    subject: int  # what the program counted it under (the port, or a pod backend's own number)
    frame: str  # "RST_STREAM" | "GOAWAY"
    code: str  # RFC 9113 name, or OTHER
    error_code: int
    direction: str  # "received" (from the client) | "sent" (by the backend)
    stream_id: int  # RST_STREAM's stream; 0 for GOAWAY
    last_stream_id: int  # GOAWAY only
    connection_stalls: int  # flow-control stalls counted on this connection up to this frame
    stream_stalled_seconds: float  # how long the reset stream's send window had been exhausted (0: not)

    @property
    def connection(self) -> tuple[int, int]:
        return (self.pid, self.fd)


class Http2Collector:
    """Per-backend HTTP/2 counters from the http2_frames BPF program.

    ``kernel`` is a loaded :class:`H2Kernel`; ``proc_root``, ``clock``
    (wall seconds) and ``monotonic_ns`` are the roots (injectable for tests).
    """

    name = "http2"

    def __init__(
        self,
        backends: Iterable[Backend],
        kernel: H2Kernel,
        config: Http2Config | None = None,
        *,
        proc_root: str | os.PathLike[str] = "/proc",
        clock: Callable[[], float] = time.time,
        monotonic_ns: Callable[[], int] = time.monotonic_ns,
        stall_reset_window_seconds: float = 2.0,
    ) -> None:
        self.config = config or Http2Config()
        self.stall_reset_window_seconds = stall_reset_window_seconds
        #: (pid, fd) -> (stall count last seen, wall time it was first seen that high)
        self._conn_stalls: dict[tuple[int, int], tuple[int, float | None]] = {}
        #: port -> RST_STREAM/GOAWAY frames that followed a stall on their connection (cumulative)
        self._stall_resets: dict[int, int] = {}
        self.kernel = kernel
        self.proc_root = proc_root
        self.clock = clock
        self.monotonic_ns = monotonic_ns
        self._backends = list(backends)
        self._backends_by_port: dict[int, list[str]] = {}
        for backend in self._backends:
            self._backends_by_port.setdefault(backend.port, []).append(backend.name)
        # What the program counts by is a "subject" (its u16 ``port`` field, which only user space
        # sets): a backend's port, or, for a backend found in another network namespace, a number of
        # its own (from 65535 down), so that pod engines on one port are counted apart. A backend
        # keeps its subject once given (its counters stay its own if its pod goes away).
        self._subject_of: dict[str, int] = {b.name: b.port for b in self._backends}
        self._subjects: dict[int, tuple[int, tuple[str, ...]]] = {}  # subject -> (port, backend names)
        self._pod_pids: dict[str, int] = {}  # backend name -> its process in another namespace
        self._pod_lookup_ns: int | None = None
        self._tables_ns: int | None = None  # when the connection tables were last read
        self._own_found: BackendSockets | None = None  # what that read found in the agent's namespace
        self._own_listeners: frozenset[tuple[int, int]] | None = None  # the listeners it found them by
        self._watched: dict[int, int] = {}  # pid -> subject at the last refresh
        self._own_netns = namespace_of(proc_root, "self")
        self._map_subjects()
        self._events: deque[H2Event] = deque(maxlen=self.config.recent_events)
        self._listening: set[int] = set()  # subjects with a listener at the last refresh
        self._seen_ports: set[int] = set()  # subjects ever traced
        self._last_refresh_ns: int | None = None
        self._last_ok_ts: float | None = None
        self._problem: str | None = None

    # -- the /proc side ---------------------------------------------------------
    def _map_subjects(self) -> None:
        subjects: dict[int, tuple[int, tuple[str, ...]]] = {}
        for backend in self._backends:
            subject = self._subject_of[backend.name]
            port, names = subjects.get(subject, (backend.port, ()))
            subjects[subject] = (port, names + (backend.name,))
        self._subjects = subjects

    def refresh(self, full: bool = True) -> None:
        """Re-read /proc: backend pids into ``watched_pids``, their connections into ``conns``.

        Reading the connection tables (``/proc/net/tcp*``, or a pod's ``/proc/PID/net/tcp*``) costs a
        walk of the kernel's whole TCP hash table, ~5 ms of CPU per table here whatever the number of
        sockets: ~1 % of a core at one refresh a second. So ``full=False`` (what :meth:`collect`
        does every ``refresh_seconds``) reads only the listeners (sock_diag walks just the
        listening hash) and checks that the pods' processes are there; the tables are read again
        when a listener changed, and every :data:`TABLES_SECONDS`. In between, the program adopts
        new connections itself, by their preface. ``full=True`` reads everything now."""
        scanned_at = self.monotonic_ns()
        # Backends still counted by their port: their listeners are in the agent's namespace.
        by_port = {subject for subject, (port, names) in self._subjects.items() if subject == port and names}
        listeners = self._listeners(by_port)
        read_tables = (full or self._own_found is None or listeners is None or listeners != self._own_listeners
                       or self._tables_ns is None or scanned_at - self._tables_ns >= TABLES_SECONDS * 1e9)
        if read_tables:
            found = backend_sockets(by_port, self.proc_root)
            self._own_found, self._own_listeners, self._tables_ns = found, listeners, scanned_at
            connections = dict(found.connections)
            scanned = set(found.pid_ports)
        else:
            found = self._own_found
            connections, scanned = {}, set()  # the program's entries for these pids stay as they are
        pid_subjects = {pid: owned[0] for pid, owned in found.pid_ports.items()}
        listening = {port for owned in found.pid_ports.values() for port in owned}
        for name, pid in list(self._pod_pids.items()):
            subject = self._subject_of[name]
            if read_tables:
                fds = pid_sockets(pid, self._subjects[subject][0], self.proc_root)
                if fds is None:
                    del self._pod_pids[name]  # gone (or restarted with a new pid): looked for again
                    continue
                connections.update({(pid, fd): subject for fd in fds})
                scanned.add(pid)
            elif not os.path.exists(os.path.join(self.proc_root, str(pid))):
                del self._pod_pids[name]
                continue
            pid_subjects[pid] = subject
            listening.add(subject)
        if self._pod_lookup_due(scanned_at, listening):
            self._pod_lookup_ns = scanned_at
            for pid, subject, fds in self._find_pod_backends(listening):
                pid_subjects[pid] = subject
                connections.update({(pid, fd): subject for fd in fds})
                scanned.add(pid)
                listening.add(subject)
        self._listening = listening
        self._seen_ports.update(listening)
        self.kernel.set_pids(pid_subjects)
        # Only the processes whose fds were read now lose the entries that the read did not find,
        # and a process no longer watched loses all of its entries.
        self.kernel.sync_connections(connections, scanned_at, scanned | (set(self._watched) - set(pid_subjects)))
        self._watched = dict(pid_subjects)
        self._last_refresh_ns = scanned_at

    def _listeners(self, ports: set[int]) -> frozenset[tuple[int, int]] | None:
        """``(inode, port)`` of the LISTEN sockets on ``ports`` in the agent's namespace (None: unreadable)."""
        if not ports:
            return frozenset()
        try:
            return frozenset((s.inode, s.port) for s in listening_sockets(self.proc_root) if s.port in ports)
        except Exception as exc:  # noqa: BLE001 - then the tables are read, as before
            log.debug("http2: listing the listeners failed: %s", exc)
            return None

    def _pod_lookup_due(self, now_ns: int, listening: set[int]) -> bool:
        if all(subject in listening for subject, (_, names) in self._subjects.items() if names):
            return False
        return self._pod_lookup_ns is None or now_ns - self._pod_lookup_ns >= POD_LOOKUP_SECONDS * 1e9

    def _find_pod_backends(self, listening: set[int]) -> list[tuple[int, int, list[int]]]:
        """``(pid, subject, accepted fds)`` of the backends that no process of the agent's
        namespace serves and whose address is that of another local namespace's listener."""
        unserved = [b for b in self._backends
                    if self._subject_of[b.name] not in listening and b.name not in self._pod_pids]
        if not unserved:
            return []
        try:
            pids = local_backend_pids(unserved, self.proc_root)
        except Exception as exc:  # noqa: BLE001 - best effort: the backends stay unserved, and say so
            log.warning("http2: looking for backends in other network namespaces failed: %s", exc)
            return []
        found: dict[tuple[int, int], list[Backend]] = {}
        for backend in unserved:
            pid = pids.get(backend.name)
            if pid is None or namespace_of(self.proc_root, pid) in (None, self._own_netns):
                continue
            found.setdefault((pid, backend.port), []).append(backend)
        out = []
        for (pid, port), group in found.items():
            fds = pid_sockets(pid, port, self.proc_root)
            if fds is None:
                continue
            subject = self._pod_subject(tuple(sorted(b.name for b in group)))
            for backend in group:
                self._subject_of[backend.name] = subject
                self._pod_pids[backend.name] = pid
            out.append((pid, subject, fds))
        if out:
            self._map_subjects()
        return out

    def _pod_subject(self, names: tuple[str, ...]) -> int:
        """The subject of backends served by one process in another namespace: the one they had,
        else a number no backend port and no other subject uses."""
        current = {self._subject_of[n] for n in names}
        if len(current) == 1:
            (subject,) = current
            if subject not in self._backends_by_port:
                return subject  # theirs already (found again after a restart)
        used = set(self._backends_by_port) | set(self._subject_of.values())
        subject = 65535
        while subject in used:
            subject -= 1
        return subject

    def _refresh_due(self) -> bool:
        if self._last_refresh_ns is None:
            return True
        return self.monotonic_ns() - self._last_refresh_ns >= self.config.refresh_seconds * 1e9

    # -- collecting ---------------------------------------------------------------
    def collect(self, now: float) -> list[Sample]:
        if self._refresh_due():
            self.refresh(full=False)
        self._take_events()
        stats = self.kernel.read_stats()
        conns = self.kernel.read_connections()
        self._note_stalls(conns, self.clock())
        samples: list[Sample] = []
        missing = set()
        for subject, (port, names) in sorted(self._subjects.items()):
            if not names:
                continue
            if subject not in self._listening:
                missing.add(port)
            if subject not in self._seen_ports:
                continue  # never traced: no numbers, not zeros
            # A backend that stopped listening (shutdown with grace) keeps its counters.
            signals = _backend_signals(subject, stats, conns)
            signals["h2_stall_then_reset_total"] = self._stall_resets.get(subject, 0)
            for name in names:
                samples.extend(Sample(Scope.BACKEND, name, signal, value) for signal, value in signals.items())
        self._problem = (
            f"no local process listens on port(s) {', '.join(map(str, sorted(missing)))}" if missing else None
        )
        self._last_ok_ts = now
        return samples

    def _take_events(self) -> None:
        mono_now = self.monotonic_ns()
        wall_now = self.clock()
        for raw in self.kernel.poll_events():
            event = _event(raw, self._subjects, wall_now - (mono_now - raw.ts_ns) / 1e9)
            self._events.append(event)
            self._join_stall(event)

    # -- stall -> reset, per connection ----------------------------------------------
    def _join_stall(self, event: H2Event) -> None:
        """Count ``event`` in ``h2_stall_then_reset_total`` when its connection stalled shortly before.

        A stall is counted by the program when it *ends* (docs/http2.md), so the
        connection's stall count is a clock of stall ends: a count higher than the last
        one seen means a stall ended since that observation (a tick ago at most) or with
        this very frame; a count seen rising within the window before the frame counts
        too, and so does a reset stream whose own window was exhausted for a stall's length.
        """
        key = event.connection
        seen, rise_ts = self._conn_stalls.get(key, (0, None))
        if event.connection_stalls > seen:
            seen, rise_ts = event.connection_stalls, event.ts
            joined = True
        else:
            joined = event.stream_stalled_seconds >= self.config.stall_seconds or (
                rise_ts is not None and event.ts - rise_ts <= self.stall_reset_window_seconds
            )
        self._conn_stalls[key] = (seen, rise_ts)
        if joined:
            self._stall_resets[event.subject] = self._stall_resets.get(event.subject, 0) + 1

    def _note_stalls(self, conns: list[ConnectionCounters], wall_now: float) -> None:
        """Record when each traced connection's stall count was first seen higher; forget closed ones."""
        known: dict[tuple[int, int], tuple[int, float | None]] = {}
        for c in conns:
            seen, rise_ts = self._conn_stalls.get((c.pid, c.fd), (0, None))
            if c.stalls > seen:
                seen, rise_ts = c.stalls, wall_now
            known[(c.pid, c.fd)] = (seen, rise_ts)
        self._conn_stalls = known

    def recent_events(self, since: float | None = None, backend: str | None = None) -> list[H2Event]:
        """RST_STREAM/GOAWAY events (oldest first), optionally since a wall time and for one backend.
        Drains the kernel ring buffer first, so it is current between ticks too."""
        self._take_events()
        return [e for e in self._events
                if (since is None or e.ts >= since) and (backend is None or e.backend == backend)]

    def connections(self) -> list[ConnectionCounters]:
        """Per-connection counters of the traced connections (stalls, resets, EAGAIN)."""
        return self.kernel.read_connections()

    # -- contract -------------------------------------------------------------
    def status(self) -> CollectorStatus:
        errors = self.kernel.errors()
        problems = [self._problem] if self._problem else []
        lost = errors.get("lost_events", 0)
        if errors.get("map_full"):
            problems.append(f"{errors['map_full']} BPF map insert(s) or ring buffer write(s) failed (map full)")
        if lost:
            problems.append(f"{lost} event(s) lost")
        if errors.get("tail_call"):
            problems.append(f"frame walker missing for {errors['tail_call']} syscall(s)")
        path = "tracepoint:syscalls (sys_enter/exit of read, readv, recvfrom, recvmsg, write, writev, sendto, sendmsg)"
        if problems:
            return CollectorStatus(CollectorState.DEGRADED, "; ".join(problems) + f" [{path}]", self._last_ok_ts)
        return CollectorStatus(CollectorState.OK, path, self._last_ok_ts)

    def close(self) -> None:
        self.kernel.close()


def _backend_signals(subject: int, stats: dict, conns: list[ConnectionCounters]) -> dict[str, object]:
    rst = Labelled()
    goaway = Labelled()
    window_updates = Labelled()
    settings = Labelled()
    opened = closed = stalls = eagain = resyncs = 0
    for direction in ("received", "sent"):
        counters = stats.get((subject, direction))
        window_updates[label_key(direction=direction)] = int(counters["window_updates"]) if counters else 0
        settings[label_key(direction=direction)] = int(counters["settings"]) if counters else 0
        if not counters:
            continue
        opened += int(counters["streams_opened"])
        closed += int(counters["streams_closed"])
        stalls += int(counters["stalls"])
        eagain += int(counters["send_eagain"])
        resyncs += int(counters["desyncs"])
        for code, count in code_counts(counters["rst_stream"]).items():
            rst.add(count, code=code, direction=direction)
        for code, count in code_counts(counters["goaway"]).items():
            goaway.add(count, code=code, direction=direction)
    return {
        "h2_streams_opened_total": opened,
        "h2_streams_closed_total": closed,
        "h2_rst_stream_total": rst,
        "h2_goaway_total": goaway,
        "h2_flow_control_stalls_total": stalls,
        "grpc_connections": sum(1 for c in conns if c.port == subject and c.confirmed),
        "h2_window_update_total": window_updates,
        "h2_settings_total": settings,
        "h2_send_eagain_total": eagain,
        "h2_parse_resyncs_total": resyncs,
    }


def _event(raw: RawEvent, subjects: dict[int, tuple[int, tuple[str, ...]]], wall_ts: float) -> H2Event:
    port, names = subjects.get(raw.port, (raw.port, ()))  # the program's "port" is the subject
    return H2Event(
        ts=wall_ts, backend=names[0] if names else f"port:{port}", pid=raw.pid, fd=raw.fd, port=port,
        subject=raw.port, frame=raw.frame,
        code=code_name(raw.error_code), error_code=raw.error_code, direction=raw.direction,
        stream_id=raw.stream_id, last_stream_id=raw.last_stream_id, connection_stalls=raw.conn_stalls,
        stream_stalled_seconds=raw.stream_stalled_ns / 1e9,
    )


def attach_points() -> list[AttachNeed]:
    """The attach points of the http2 collector, read from its BPF program (``llmdiag doctor``):
    syscall tracepoints, all needed (frames are walked at the syscalls that move them)."""
    return [
        AttachNeed("http2", "tracepoint", f"{category}:{event}",
                   "HTTP/2 frames sent" if "write" in event or "send" in event
                   else "connection closes" if event.endswith("close") else "HTTP/2 frames received", True)
        for category, event in program_tracepoints("http2_frames")
    ]


def build_http2_collector(config: Config, backends: list[Backend]) -> Http2Collector:
    """Compile and load the program for the ``grpc://`` backends.

    Raises :class:`llmdiag.bpf.loader.BPFUnavailable` when BPF cannot load, and
    also when no backend is a ``grpc://`` one: enabling syscall tracepoints
    costs every process on the host a little, so nothing is loaded for nothing."""
    grpc_backends = [b for b in backends if b.scheme == "grpc"]
    if not grpc_backends:
        raise BPFUnavailable("no grpc:// backends to trace", "pass --backend grpc://HOST:PORT or a [[backends]] grpc url")
    kernel = H2Kernel.load(config.http2)
    # One knob for the stall -> reset join: the diagnosis rule's follow_seconds.
    window = config.diagnosis.rule("grpc_flow_control_stall").follow_seconds
    collector = Http2Collector(grpc_backends, kernel, config.http2, stall_reset_window_seconds=window)
    try:
        collector.refresh()
    except Exception:
        collector.close()
        raise
    return collector

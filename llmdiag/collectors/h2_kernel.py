"""The http2_frames BPF program as Python objects: load, feed, read.

:class:`H2Kernel` owns one loaded ``http2_frames`` program (via
:class:`llmdiag.bpf.loader.Program`) and offers what the collector needs:

* :meth:`set_pids` / :meth:`sync_connections`: push the backend pids and their
  connected (pid, fd) pairs found in /proc into the ``watched_pids`` and
  ``conns`` maps (new pairs are inserted with ``BPF_NOEXIST`` so a
  connection the program is already walking keeps its parser state);
* :meth:`read_stats`, :meth:`read_connections`: the cumulative counters;
* :meth:`poll_events`: RST_STREAM/GOAWAY records from the ring buffer.

The tail-called walker is loaded with :meth:`Program.load_function` and put
into the ``walkers`` prog array with :meth:`Program.set_prog_array`.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from llmdiag.bpf.loader import BPFUnavailable, Program
from llmdiag.config.http2 import Http2Config

__all__ = [
    "DIRECTIONS",
    "ERROR_CODES",
    "H2_STATE_CONFIRMED",
    "ConnectionCounters",
    "H2Kernel",
    "RawEvent",
    "code_counts",
    "code_name",
    "program_defines",
]

PROGRAM = "http2_frames"

#: RFC 9113 section 7 error codes, by value.
ERROR_CODES = (
    "NO_ERROR", "PROTOCOL_ERROR", "INTERNAL_ERROR", "FLOW_CONTROL_ERROR", "SETTINGS_TIMEOUT",
    "STREAM_CLOSED", "FRAME_SIZE_ERROR", "REFUSED_STREAM", "CANCEL", "COMPRESSION_ERROR",
    "CONNECT_ERROR", "ENHANCE_YOUR_CALM", "INADEQUATE_SECURITY", "HTTP_1_1_REQUIRED",
)
CODE_OTHER_SLOT = 15  # H2_CODE_OTHER in http2_frames.h
DIRECTIONS = ("received", "sent")  # index = enum h2_dir
FRAME_NAMES = {3: "RST_STREAM", 7: "GOAWAY"}
H2_STATE_CONFIRMED = 2
_ORIGIN_USER = 1
_DEFAULT_WINDOW = 65535
_ERR_TAIL_CALL = 2  # LLMDIAG_ERR_TAIL_CALL in http2_frames.bpf.c


def code_name(code: int) -> str:
    """RFC 9113 name of an error code; codes outside the registry are ``OTHER``."""
    return ERROR_CODES[code] if 0 <= code < len(ERROR_CODES) else "OTHER"


def program_defines(config: Http2Config) -> dict[str, int]:
    """The ``-D`` options the collector compiles http2_frames.bpf.c with."""
    return {
        "H2_MAX_CONNS": config.max_connections,
        "H2_MAX_STREAMS": config.max_streams,
        "H2_STEPS_PER_CALL": config.steps_per_run,
        "H2_MAX_ROUNDS": config.max_runs,
        "H2_STALL_NS": int(config.stall_seconds * 1e9),
    }


@dataclass(frozen=True, slots=True)
class RawEvent:
    """One ``struct h2_event`` as the kernel wrote it (monotonic ns)."""

    ts_ns: int
    pid: int
    fd: int
    port: int
    frame: str  # RST_STREAM | GOAWAY
    direction: str  # received | sent
    error_code: int
    stream_id: int
    last_stream_id: int
    conn_stalls: int
    stream_stalled_ns: int


@dataclass(frozen=True, slots=True)
class ConnectionCounters:
    """One ``conns`` entry: a traced (pid, fd) and its per-connection counts."""

    pid: int
    fd: int
    port: int
    confirmed: bool
    stalls: int
    rst_stream: int
    goaway: int
    send_eagain: int
    desyncs: int
    created_ns: int


class _Event(ctypes.Structure):
    """``struct h2_event`` (http2_frames.h); bcc cannot derive it from ``__u64`` fields itself."""

    _fields_ = [
        ("ts_ns", ctypes.c_uint64),
        ("conn_stalls", ctypes.c_uint64),
        ("stream_stalled_ns", ctypes.c_uint64),
        ("tgid", ctypes.c_uint32),
        ("fd", ctypes.c_uint32),
        ("stream_id", ctypes.c_uint32),
        ("error_code", ctypes.c_uint32),
        ("last_stream_id", ctypes.c_uint32),
        ("port", ctypes.c_uint16),
        ("frame_type", ctypes.c_uint8),
        ("dir", ctypes.c_uint8),
    ]


class H2Kernel:
    """A loaded http2_frames program. ``load`` raises :class:`BPFUnavailable`."""

    def __init__(self, program: Program) -> None:
        self.program = program
        self._events: list[RawEvent] = []

    @classmethod
    def load(cls, config: Http2Config, loader: Callable[..., Program] = Program.load) -> H2Kernel:
        program = loader(PROGRAM, program_defines(config))
        kernel = cls(program)
        program.name_errors({_ERR_TAIL_CALL: "tail_call"})
        try:
            _install_walker(program)
            program.open_ring_buffer("h2_events", kernel._on_event)
        except BPFUnavailable:
            program.close()
            raise
        except Exception as exc:  # noqa: BLE001 - bcc raises bare Exception
            program.close()
            raise BPFUnavailable(f"opening the http2 event ring buffer failed: {exc}") from exc
        return kernel

    # -- feeding -------------------------------------------------------------
    def set_pids(self, pid_ports: Mapping[int, int]) -> None:
        """Make ``watched_pids`` exactly ``pid -> backend port``."""
        table = self.program.table("watched_pids")
        current = {int(k.value) for k in table.keys()}
        for pid in current - set(pid_ports):
            try:
                del table[table.Key(pid)]
            except KeyError:
                pass
        for pid, port in pid_ports.items():
            leaf = table.Leaf()
            leaf.port = port
            table[table.Key(pid)] = leaf

    def sync_connections(self, connections: Mapping[tuple[int, int], int], scanned_at_ns: int,
                         scanned_pids: Container[int] | None = None) -> int:
        """Insert the (pid, fd) -> port pairs that are missing; drop entries for
        pairs that are no longer sockets on a backend port (closed or reused
        fds) unless the program created them after the /proc scan began.
        ``scanned_pids``: the processes whose fds this scan read (None: all); the
        entries of the others are kept as they are. Returns how many pairs were inserted."""
        table = self.program.table("conns")
        inserted = 0
        existing: dict[tuple[int, int], Any] = {}
        for key, value in table.items():
            existing[(int(key.tgid), int(key.fd))] = value
        for (pid, fd), value in existing.items():
            if scanned_pids is not None and pid not in scanned_pids:
                continue
            if (pid, fd) not in connections and int(value.created_ns) < scanned_at_ns:
                key = table.Key()
                key.tgid, key.fd = pid, fd
                try:
                    del table[key]
                except KeyError:
                    pass
        for (pid, fd), port in connections.items():
            if (pid, fd) in existing:
                continue
            leaf = {"port": port, "origin": _ORIGIN_USER, "created_ns": time.monotonic_ns(),
                    "peer_initial_window": _DEFAULT_WINDOW, "conn_send_window": _DEFAULT_WINDOW}
            # noexist: if the program adopted this fd meanwhile, keep its state.
            try:
                if self.program.update_map("conns", {"tgid": pid, "fd": fd}, leaf, exist="noexist"):
                    inserted += 1
            except OSError:
                pass  # map full: the pair is tried again on the next sync
        return inserted

    # -- reading -------------------------------------------------------------
    def read_stats(self) -> dict[tuple[int, str], dict[str, Any]]:
        """``(port, direction) -> cumulative counters`` (``rst_stream``/``goaway`` are lists by code slot)."""
        out: dict[tuple[int, str], dict[str, Any]] = {}
        for key, value in self.program.read_hash("h2_stats"):
            out[(int(key["port"]), DIRECTIONS[int(key["dir"]) & 1])] = value
        return out

    def read_connections(self) -> list[ConnectionCounters]:
        table = self.program.table("conns")
        conns = []
        for key, v in table.items():
            conns.append(ConnectionCounters(
                pid=int(key.tgid), fd=int(key.fd), port=int(v.port), confirmed=int(v.state) == H2_STATE_CONFIRMED,
                stalls=int(v.stalls), rst_stream=int(v.rst_stream), goaway=int(v.goaway),
                send_eagain=int(v.send_eagain), desyncs=int(v.desyncs), created_ns=int(v.created_ns),
            ))
        return conns

    def poll_events(self) -> list[RawEvent]:
        """Drain the ring buffer; returns the events that arrived since the last call."""
        self.program.poll(0)
        events, self._events = self._events, []
        return events

    def errors(self) -> dict[str, int]:
        """``map_full``, ``read``, ``tail_call`` and ``lost_events`` counts (:meth:`Program.errors`)."""
        return self.program.errors()

    def close(self) -> None:
        self.program.close()

    def _on_event(self, _ctx: Any, data: Any, _size: int) -> None:
        ev = ctypes.cast(data, ctypes.POINTER(_Event)).contents
        self._events.append(RawEvent(
            ts_ns=int(ev.ts_ns), pid=int(ev.tgid), fd=int(ev.fd), port=int(ev.port),
            frame=FRAME_NAMES.get(int(ev.frame_type), str(int(ev.frame_type))),
            direction=DIRECTIONS[int(ev.dir) & 1], error_code=int(ev.error_code), stream_id=int(ev.stream_id),
            last_stream_id=int(ev.last_stream_id), conn_stalls=int(ev.conn_stalls),
            stream_stalled_ns=int(ev.stream_stalled_ns),
        ))


def _install_walker(program: Program) -> None:
    """Load the tail-called ``h2_walk`` (a tracepoint program, like its callers) and
    put it in ``walkers[0]``."""
    try:
        program.set_prog_array("walkers", 0, program.load_function("h2_walk", "tracepoint"))
    except BPFUnavailable as exc:
        raise BPFUnavailable(f"loading the http2 frame walker failed: {exc.reason}",
                             "lower [http2] steps_per_run; see `llmdiag doctor`") from exc


def code_counts(per_slot: Iterable[int]) -> dict[str, int]:
    """``[n0, n1, ...]`` by code slot -> ``{"CANCEL": n8, ...}`` without zeros."""
    out: dict[str, int] = {}
    for slot, count in enumerate(per_slot):
        if count:
            name = "OTHER" if slot == CODE_OTHER_SLOT or slot >= len(ERROR_CODES) else ERROR_CODES[slot]
            out[name] = out.get(name, 0) + int(count)
    return out

"""``[tcp]`` (the BPF TCP collector) and ``[timewait]`` (TIME_WAIT and port headroom)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TcpConfig", "TimewaitConfig"]


def _check_port(port: int, key: str) -> None:
    if not 1 <= port <= 65535:
        raise ValueError(f"{key}: port must be 1..65535, got {port}")


@dataclass(frozen=True)
class TcpConfig:
    #: Extra local listen ports to watch on the server side (backends' ports are always watched).
    server_ports: tuple[int, ...] = ()
    #: Extra remote ports to watch on the client side, per remote ip:port (backends' ports are always watched).
    client_ports: tuple[int, ...] = ()
    #: Time send syscalls of the backend processes (blocking senders' send-buffer waits).
    #: Off by default: it attaches to sendto/sendmsg/write/writev entry, so every such syscall on
    #: the host pays a tracepoint and a pid lookup (~50 ns in BPF plus the dispatch; docs/tcp.md).
    send_timing: bool = False
    #: Extra process ids whose send syscalls are timed (backends' pids are found from their listen sockets).
    timed_pids: tuple[int, ...] = ()
    #: A timed send at least this long counts in tcp_sndbuf_full_total (it waited for buffer space).
    send_block_seconds: float = 0.001
    #: Sample 1 in this many tcp:tcp_probe events for srtt (a power of two; 1 = every event).
    srtt_sample_every: int = 8
    #: Window of the connect latency distribution (p50/p99).
    connect_latency_window_seconds: float = 60.0
    #: BPF map sizes.
    max_sockets: int = 65536
    max_endpoints: int = 4096

    def __post_init__(self) -> None:
        for port in self.server_ports:
            _check_port(port, "tcp.server_ports")
        for port in self.client_ports:
            _check_port(port, "tcp.client_ports")
        if not 0 < self.send_block_seconds < 60:
            raise ValueError(f"tcp.send_block_seconds must be in (0, 60), got {self.send_block_seconds}")
        n = self.srtt_sample_every
        if n < 1 or n & (n - 1):
            raise ValueError(f"tcp.srtt_sample_every must be a power of two >= 1, got {n}")
        if not self.connect_latency_window_seconds > 0:
            raise ValueError("tcp.connect_latency_window_seconds must be > 0")
        if not 1024 <= self.max_sockets <= 1 << 22:
            raise ValueError(f"tcp.max_sockets must be 1024..4194304, got {self.max_sockets}")
        if not 16 <= self.max_endpoints <= 1 << 20:
            raise ValueError(f"tcp.max_endpoints must be 16..1048576, got {self.max_endpoints}")
        if any(p <= 0 for p in self.timed_pids):
            raise ValueError("tcp.timed_pids must be positive process ids")


@dataclass(frozen=True)
class TimewaitConfig:
    #: Window over which the TIME_WAIT entry rate per destination is averaged.
    rate_window_seconds: float = 10.0
    #: Report at most this many destinations (those with the most TIME_WAIT sockets, backends first).
    max_destinations: int = 64
    #: Destinations with fewer TIME_WAIT sockets than this are not reported (backends always are).
    min_sockets: int = 10
    #: The per-destination sock_diag dump (the kernel walks every TCP socket) runs every this many
    #: ticks, and at once when the host's TIME_WAIT total moved or the backends changed; in between
    #: the per-destination signals repeat the last dump's counts with the entry rate read fresh.
    #: 1 = every tick.
    dump_every_ticks: int = 5

    def __post_init__(self) -> None:
        if not self.rate_window_seconds > 0:
            raise ValueError(f"timewait.rate_window_seconds must be > 0, got {self.rate_window_seconds}")
        if self.max_destinations < 1:
            raise ValueError(f"timewait.max_destinations must be >= 1, got {self.max_destinations}")
        if self.min_sockets < 0:
            raise ValueError(f"timewait.min_sockets must be >= 0, got {self.min_sockets}")
        if not (isinstance(self.dump_every_ticks, int) and self.dump_every_ticks >= 1):
            raise ValueError(f"timewait.dump_every_ticks must be an integer >= 1, got {self.dump_every_ticks!r}")

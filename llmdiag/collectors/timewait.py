"""TIME_WAIT build-up and ephemeral port headroom, per destination ``ip:port``.

Sources (SPEC section 4, "timewait"):

* host total: ``/proc/net/sockstat`` (``TCP: ... tw N``), plus ``inuse``;
* per destination: a sock_diag dump of TCP sockets (what ``ss -tan state
  time-wait`` reads), grouped by remote ``ip:port``;
* headroom: ``ip_local_port_range`` minus ``ip_local_reserved_ports``. A
  client connecting to one ``ip:port`` from one source address has exactly
  that many 4-tuples, so the ports it holds towards that destination (any
  state but LISTEN, local port in the range) are gone, TIME_WAIT included,
  unless ``tcp_tw_reuse`` applies (1, or 2 for loopback destinations): then
  TIME_WAIT sockets older than 1 s can be reused by ``connect()`` and only
  the ones younger than that count;
* entry rate: the active closes that the tcp collector counts in BPF for that
  destination (exact) when it runs; otherwise from the kernel's own timers:
  a TIME_WAIT socket lives ``TCP_TIMEWAIT_LEN`` = 60 s, so the ones with more
  than ``60 s - W`` left entered within the last ``W`` seconds (one read, no
  history needed, unlike count deltas, which expiries hide);
* ``port_exhaustion_eta_seconds`` = ports available / entry rate (absent while
  the rate is zero: nothing is running out).

The sock_diag dump is most of the collector's cost (the kernel walks its whole
TCP hash table to answer it), and a TIME_WAIT socket lives 60 s, so it runs
every ``[timewait] dump_every_ticks`` ticks (default 5), and at once on the
first tick, after a failed dump, when the backends change, and when the host's
TIME_WAIT total (``sockstat``, read every tick) has moved by more than
:data:`REDUMP_SOCKETS` or :data:`REDUMP_FRACTION` of it since the last dump (a
storm starting). In between, every per-destination signal is still there each
tick: the counts repeat the last dump, the entry rate is read fresh from the
tcp collector's counters when it runs (else the last dump's timers), and the
headroom and ETA are worked out again from both. A count is then at most
``dump_every_ticks - 1`` ticks old; for the ETA that errs by at most that many
seconds, against rule bars of minutes.

Works without BPF and without root for the ``/proc`` part; sock_diag needs no
privilege for TCP dumps either.

llmdiag's own sockets (its scrapes, :mod:`llmdiag.collectors.own_sockets`) are
left out of the per-destination counts: the agent never blames a backend for
TIME_WAIT it made itself. The host total (``sockstat``) is the kernel's and
keeps them.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import socket
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from llmdiag.collectors import procnet
from llmdiag.collectors.own_sockets import OWN_PORTS
from llmdiag.collectors.procfd import KeptFiles, is_procfs
from llmdiag.collectors.sample_reuse import SampleReuse
from llmdiag.collectors.sockdiag import SockDiagError, dump_tcp
from llmdiag.config.tcp import TimewaitConfig
from llmdiag.model import Backend, CollectorState, CollectorStatus, Sample, Scope

__all__ = ["ActiveCloseSource", "TimewaitCollector", "backend_destination", "build_timewait_collector"]

log = logging.getLogger("llmdiag.collectors.timewait")

#: Cumulative active closes (entries into TIME_WAIT) per destination ``ip:port``, or ``None`` when unknown.
ActiveCloseSource = Callable[[], Mapping[str, int] | None]

_HELD_STATES = ("ESTABLISHED", "SYN_SENT", "FIN_WAIT1", "FIN_WAIT2", "TIME_WAIT", "CLOSE_WAIT", "LAST_ACK", "CLOSING")
#: tcp_twsk_unique(): a TIME_WAIT socket is reusable once its last timestamp is > 1 s old.
_TW_REUSE_AGE_SECONDS = 1.0
#: Dump again before the cadence is due when the host's TIME_WAIT total moved by more than this
#: many sockets and this fraction of the total at the last dump (idle noise stays below both).
REDUMP_SOCKETS = 50
REDUMP_FRACTION = 0.1


@functools.lru_cache(maxsize=4096)  # the same destinations every tick; parsing an address is not free
def _is_loopback(destination: str) -> bool:
    host = destination.rsplit(":", 1)[0].strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def backend_destination(backend: Backend) -> str:
    """The ``ip:port`` key under which the kernel (sock_diag, the tcp collector) and so the
    ``host.destinations`` signals name connections to ``backend``.

    A host name is resolved once (the kernel reports addresses); IPv4-mapped IPv6
    addresses become plain IPv4 and IPv6 is bracketed. A name that cannot be resolved
    stays ``name:port``. The analyzers use the same function to find a backend's
    destination, so the two sides cannot disagree.
    """
    host = backend.host
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        try:  # a name: resolve once, at start (the kernel reports addresses)
            host = socket.getaddrinfo(host, backend.port, type=socket.SOCK_STREAM)[0][4][0]
            ip = ipaddress.ip_address(host)
        except (OSError, ValueError, IndexError):
            return f"{host}:{backend.port}"
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return f"{ip.ipv4_mapped}:{backend.port}"
        return f"[{ip.compressed}]:{backend.port}"
    return f"{ip}:{backend.port}"


class TimewaitCollector:
    """``timewait`` collector: host and per-destination TIME_WAIT signals."""

    name = "timewait"

    def __init__(
        self,
        config: TimewaitConfig | None = None,
        backends: Iterable[Backend] = (),
        proc_root: str | Path = "/proc",
        clock: Callable[[], float] = time.monotonic,
        diag: Callable[..., Mapping[str, object]] = dump_tcp,
        entry_source: ActiveCloseSource | None = None,
        own_connections: Callable[[], frozenset[tuple[int, int]]] = OWN_PORTS.pairs,
    ) -> None:
        self.config = config or TimewaitConfig()
        self.own_connections = own_connections
        self.proc_root = Path(proc_root)
        self.clock = clock
        self.diag = diag
        self.entry_source = entry_source
        self.backend_destinations = {backend_destination(b) for b in backends}
        self._history: deque[tuple[float, dict[str, int]]] = deque()
        self._problems: list[str] = []
        self._last_ok_ts: float | None = None
        self.entry_rate_source = "timers"
        self.dump_every_ticks = max(1, int(getattr(self.config, "dump_every_ticks", 1)))
        self._tick = 0
        # The last good dump: (its tick, the host's TIME_WAIT total then, its per-destination counts).
        self._dump: tuple[int, int | None, Mapping[str, object]] | None = None
        self.dumps_total = 0  # sock_diag dumps sent (the tests and the benchmark read it)
        self._reuse = SampleReuse()
        # On a real procfs the four files read every tick stay open (see procfd), and a file
        # whose text repeats is not parsed again: rel path -> (text, parsed) of the last read.
        self._kept: KeptFiles | None = KeptFiles() if is_procfs(str(self.proc_root)) else None
        self._parsed: dict[str, tuple[str, Any]] = {}
        self._usable: tuple[procnet.PortRange, frozenset[int], int] | None = None

    def set_entry_source(self, source: ActiveCloseSource | None) -> None:
        self.entry_source = source

    def set_backends(self, backends: Iterable[Backend]) -> None:
        """Watch these backends' destinations from the next tick on; a new one is dumped at once."""
        destinations = {backend_destination(b) for b in backends}
        if destinations - self.backend_destinations:
            self._dump = None
        self.backend_destinations = destinations

    # -- collection ------------------------------------------------------------
    def collect(self, now: float) -> list[Sample]:
        self._problems = []
        self._tick += 1
        samples: list[Sample] = []
        host_tw: int | None = None
        try:
            tcp = self._read("net/sockstat", procnet.read_sockstat, procnet.parse_sockstat)["TCP"]
        except procnet.ProcNetError as exc:
            self._problems.append(str(exc))
        else:
            host_tw = tcp.get("tw")
            for key, name in (("tw", "sockstat_tcp_tw"), ("inuse", "sockstat_tcp_inuse")):
                if key in tcp:
                    samples.append(Sample(Scope.HOST, "", name, tcp[key]))
            if "tw" in tcp:
                samples.append(Sample(Scope.HOST, "", "timewait_sockets", tcp["tw"]))

        port_range, usable, reuse = self._headroom()
        window = min(self.config.rate_window_seconds, 60.0)
        per_dest: Mapping[str, object] | None = None
        if self._dump_due(host_tw):
            self._dump = None
            try:
                per_dest = self.diag(
                    states=_HELD_STATES,
                    ephemeral=range(port_range.low, port_range.high + 1) if port_range else None,
                    recent_ms=int(window * 1000),
                    exclude=self.own_connections(),
                )
            except (SockDiagError, OSError) as exc:
                self._problems.append(f"sock_diag dump failed: {exc}")  # tried again next tick
            else:
                self._dump = (self._tick, host_tw, per_dest)
            self.dumps_total += 1
        elif self._dump is not None:
            per_dest = self._dump[2]
        if per_dest is not None:
            samples.extend(self._destination_samples(per_dest, usable, reuse, window))
        if not self._problems:
            self._last_ok_ts = now
        return samples

    def _dump_due(self, host_tw: int | None) -> bool:
        """Whether this tick sends the sock_diag dump (see the module docstring)."""
        if self._dump is None:
            return True
        tick, dumped_tw, _ = self._dump
        if self._tick - tick >= self.dump_every_ticks:
            return True
        if host_tw is None or dumped_tw is None:
            return False
        moved = abs(host_tw - dumped_tw)
        return moved > REDUMP_SOCKETS and moved > REDUMP_FRACTION * dumped_tw

    def _headroom(self) -> tuple[procnet.PortRange | None, int | None, int | None]:
        try:
            port_range = self._read("sys/net/ipv4/ip_local_port_range", procnet.read_port_range,
                                    procnet.parse_port_range)
        except procnet.ProcNetError as exc:
            self._problems.append(str(exc))
            return None, None, None
        try:
            reserved = self._read("sys/net/ipv4/ip_local_reserved_ports", procnet.read_reserved_ports,
                                  procnet.parse_reserved_ports)
        except procnet.ProcNetError as exc:
            self._problems.append(str(exc))
            reserved = frozenset()
        if self._usable is None or self._usable[:2] != (port_range, reserved):
            self._usable = (port_range, reserved, port_range.size - sum(1 for p in reserved if p in port_range))
        usable = self._usable[2]
        try:
            reuse: int | None = self._read("sys/net/ipv4/tcp_tw_reuse", procnet.read_tw_reuse, _parse_tw_reuse)
        except procnet.ProcNetError as exc:
            self._problems.append(str(exc))
            reuse = None
        return port_range, usable, reuse

    def _read(self, rel: str, by_path: Callable[[Path], Any], parse: Callable[[str, str], Any]) -> Any:
        """``by_path(proc_root)`` (a procnet reader), or on a real procfs the same from a kept
        descriptor: the same text (ASCII with replacement, newlines as text mode reads them),
        the same parse and the same ProcNetError messages. A text that repeats last tick's
        returns last tick's result (the parsers are pure, their results immutable)."""
        kept = self._kept
        if kept is None:
            return by_path(self.proc_root)
        path = str(self.proc_root / rel)
        try:
            data = kept.read(rel, path)
        except OSError as exc:
            raise procnet.ProcNetError(f"{path}: {exc.strerror or exc}") from None
        text = data.decode("ascii", "replace")
        if "\r" in text:  # read_text's universal newlines (never in the kernel's files)
            text = text.replace("\r\n", "\n").replace("\r", "\n")
        last = self._parsed.get(rel)
        if last is not None and last[0] == text:
            return last[1]
        result = parse(text, path)
        self._parsed[rel] = (text, result)
        return result

    def _bpf_rates(self, now: float) -> dict[str, float] | None:
        """Entries per second per destination from the tcp collector's cumulative
        active-close counters, over the configured window (``None``: no BPF source)."""
        totals = self.entry_source() if self.entry_source is not None else None
        if totals is None:
            self._history.clear()
            return None
        tick = self.clock()
        self._history.append((tick, dict(totals)))
        while len(self._history) > 2 and tick - self._history[1][0] >= self.config.rate_window_seconds:
            self._history.popleft()
        if len(self._history) < 2:
            return None  # one reading gives no rate yet: fall back to the timers this tick
        (t0, first), (t1, last) = self._history[0], self._history[-1]
        elapsed = t1 - t0
        if elapsed <= 0:
            return None
        return {dest: max(0, count - first.get(dest, 0)) / elapsed for dest, count in last.items()}

    def _destination_samples(
        self, per_dest: Mapping[str, object], usable: int | None, reuse: int | None, window: float
    ) -> list[Sample]:
        bpf_rates = self._bpf_rates(self.clock())
        self.entry_rate_source = "bpf" if bpf_rates is not None else "timers"
        ranked = sorted(
            (d for d, e in per_dest.items() if e.timewait >= max(self.config.min_sockets, 1)),  # type: ignore[attr-defined]
            key=lambda d: -per_dest[d].timewait,  # type: ignore[attr-defined]
        )
        chosen = list(self.backend_destinations) + [d for d in ranked if d not in self.backend_destinations]
        chosen = chosen[: max(self.config.max_destinations, len(self.backend_destinations))]
        samples: list[Sample] = []
        for dest in chosen:
            entry = per_dest.get(dest)
            tw = entry.timewait if entry is not None else 0  # type: ignore[attr-defined]
            recent = entry.timewait_recent if entry is not None else 0  # type: ignore[attr-defined]
            other = entry.other_ephemeral if entry is not None else 0  # type: ignore[attr-defined]
            if bpf_rates is not None:
                rate = bpf_rates.get(dest, 0.0)
            else:
                rate = recent / window
            signals: dict[str, float | int] = {"timewait_sockets": tw, "timewait_entry_rate": rate}
            if usable is not None:
                reusable = reuse == 1 or (reuse == 2 and _is_loopback(dest))
                held_tw = min(tw, int(rate * _TW_REUSE_AGE_SECONDS + 0.999)) if reusable else tw
                available = max(0, usable - other - held_tw)
                signals["ephemeral_ports_available"] = available
                if rate > 0:
                    signals["port_exhaustion_eta_seconds"] = available / rate
            # Between dumps most destinations repeat their signals: their samples are built once.
            samples.extend(self._reuse.each(((Scope.DESTINATION, dest),), signals))
        self._reuse.next_tick()
        return samples

    # -- contract ---------------------------------------------------------------
    def status(self) -> CollectorStatus:
        if self._problems:
            return CollectorStatus(CollectorState.DEGRADED, "; ".join(self._problems), self._last_ok_ts)
        return CollectorStatus(CollectorState.OK, None, self._last_ok_ts)

    def close(self) -> None:
        self._history.clear()
        self._dump = None
        if self._kept is not None:
            self._kept.close_all()


def _parse_tw_reuse(text: str, source: str) -> int:
    """:func:`procnet.read_tw_reuse` on text already read (the same check and message)."""
    value = text.strip()
    if value not in ("0", "1", "2"):
        raise procnet.ProcNetError(f"{source}: expected 0, 1 or 2, got {value!r}")
    return int(value)


def build_timewait_collector(config: Any, backends: list[Backend]) -> TimewaitCollector:
    """Factory for the agent. Entry rates come from the timers until the agent connects a running
    tcp collector's active-close counters with :meth:`TimewaitCollector.set_entry_source`."""
    proc_root = getattr(getattr(config, "proc", None), "proc_root", "/proc")
    return TimewaitCollector(config.timewait, backends, proc_root=proc_root)

"""``/proc/net`` and ``/proc/sys/net`` parsing for the TIME_WAIT collector.

Everything takes a ``proc_root`` so tests run on recorded files. A missing or
malformed file raises :class:`ProcNetError` naming the file; callers turn that
into a missing signal and a ``degraded`` status, never a made-up zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "PortRange",
    "ProcNetError",
    "read_port_range",
    "read_reserved_ports",
    "read_sockstat",
    "read_tw_reuse",
    "parse_port_range",
    "parse_reserved_ports",
    "parse_sockstat",
]


class ProcNetError(ValueError):
    """A /proc file that is missing or does not look like the kernel's."""


def _read(proc_root: str | Path, rel: str) -> str:
    path = Path(proc_root) / rel
    try:
        return path.read_text(encoding="ascii", errors="replace")
    except OSError as exc:
        raise ProcNetError(f"{path}: {exc.strerror or exc}") from None


def parse_sockstat(text: str, source: str = "sockstat") -> dict[str, dict[str, int]]:
    """``/proc/net/sockstat`` -> ``{"TCP": {"inuse": 1, "orphan": 0, "tw": 1948, ...}, ...}``.

    Each line is ``PROTO: key value key value ...`` (net/ipv4/proc.c,
    sockstat_seq_show). A line with an odd token count or a non-integer value
    is skipped; no usable TCP line at all is an error.
    """
    out: dict[str, dict[str, int]] = {}
    for line in text.splitlines():
        proto, sep, rest = line.partition(":")
        if not sep:
            continue
        tokens = rest.split()
        if len(tokens) % 2:
            continue
        try:
            out[proto.strip()] = {tokens[i]: int(tokens[i + 1]) for i in range(0, len(tokens), 2)}
        except ValueError:
            continue
    if "TCP" not in out:
        raise ProcNetError(f"{source}: no parsable 'TCP:' line")
    return out


def read_sockstat(proc_root: str | Path = "/proc") -> dict[str, dict[str, int]]:
    return parse_sockstat(_read(proc_root, "net/sockstat"), str(Path(proc_root) / "net/sockstat"))


@dataclass(frozen=True)
class PortRange:
    """``net.ipv4.ip_local_port_range``: ephemeral ports ``low..high`` inclusive."""

    low: int
    high: int

    @property
    def size(self) -> int:
        return self.high - self.low + 1

    def __contains__(self, port: object) -> bool:
        return isinstance(port, int) and self.low <= port <= self.high


def parse_port_range(text: str, source: str = "ip_local_port_range") -> PortRange:
    parts = text.split()
    if len(parts) != 2:
        raise ProcNetError(f"{source}: expected two numbers, got {text.strip()!r}")
    try:
        low, high = int(parts[0]), int(parts[1])
    except ValueError:
        raise ProcNetError(f"{source}: not numbers: {text.strip()!r}") from None
    if not 0 < low <= high <= 65535:
        raise ProcNetError(f"{source}: bad range {low}..{high}")
    return PortRange(low, high)


def read_port_range(proc_root: str | Path = "/proc") -> PortRange:
    rel = "sys/net/ipv4/ip_local_port_range"
    return parse_port_range(_read(proc_root, rel), str(Path(proc_root) / rel))


def parse_reserved_ports(text: str, source: str = "ip_local_reserved_ports") -> frozenset[int]:
    """``8000,9000-9010`` -> the set of ports; empty text is no reserved ports."""
    ports: set[int] = set()
    for item in text.replace("\n", "").split(","):
        item = item.strip()
        if not item:
            continue
        low, sep, high = item.partition("-")
        try:
            lo = int(low)
            hi = int(high) if sep else lo
        except ValueError:
            raise ProcNetError(f"{source}: bad item {item!r}") from None
        if not 0 <= lo <= hi <= 65535:
            raise ProcNetError(f"{source}: bad range {item!r}")
        ports.update(range(lo, hi + 1))
    return frozenset(ports)


def read_reserved_ports(proc_root: str | Path = "/proc") -> frozenset[int]:
    rel = "sys/net/ipv4/ip_local_reserved_ports"
    return parse_reserved_ports(_read(proc_root, rel), str(Path(proc_root) / rel))


def read_tw_reuse(proc_root: str | Path = "/proc") -> int:
    """``net.ipv4.tcp_tw_reuse``: 0 off, 1 on, 2 loopback only (the default since 4.19)."""
    rel = "sys/net/ipv4/tcp_tw_reuse"
    text = _read(proc_root, rel).strip()
    if text not in ("0", "1", "2"):
        raise ProcNetError(f"{Path(proc_root) / rel}: expected 0, 1 or 2, got {text!r}")
    return int(text)

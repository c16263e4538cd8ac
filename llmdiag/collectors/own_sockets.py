"""llmdiag's own TCP connections (its scrapes), so that no collector counts them against a backend.

The engine collector scrapes every backend once a tick. Those connections end
on the backend's port like any client's, so the tcp collector (server side:
the backend's listen port) and the timewait collector (client side: the
backend's ``ip:port``) would see llmdiag itself as load, churn and TIME_WAIT.
Every connection llmdiag opens binds its local port *before* connecting and
registers it here first (:func:`bound_connection`) as the pair ``(local port,
remote port)``, so the tcp collector can put it in its BPF ``own_ports`` map
before the handshake is traced, and the timewait collector can leave its
sockets out of the per-destination counts. The pair, not the port alone: the
kernel hands a released port number to the next client at once, and that
client's connections are not ours.

A pair stays registered ``linger_seconds`` (120) after its connection closed:
the TIME_WAIT socket it may leave lives 60 s (``TCP_TIMEWAIT_LEN``), and the
server side's last state changes come after the close.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

__all__ = ["OWN_PORTS", "OwnPorts", "Pair", "bound_connection"]


Pair = tuple[int, int]  # (local port, remote port) of one of llmdiag's connections


class OwnPorts:
    """``(local port, remote port)`` of llmdiag's own TCP connections (open, or closed within
    ``linger_seconds``)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, linger_seconds: float = 120.0) -> None:
        self._clock = clock
        self.linger_seconds = linger_seconds
        self._lock = threading.Lock()
        self._open: dict[Pair, int] = {}  # pair -> open connections on it
        self._closed: dict[Pair, float] = {}  # pair -> when its last connection closed
        self._listeners: list[Callable[[Pair, bool], None]] = []

    def add(self, local: int, remote: int) -> None:
        """A connection of ours from local port ``local`` to remote port ``remote`` (registered
        before it connects)."""
        pair = (local, remote)
        with self._lock:
            self._open[pair] = self._open.get(pair, 0) + 1
            self._closed.pop(pair, None)
            listeners = list(self._listeners)
        for listener in listeners:
            listener(pair, True)

    def release(self, local: int, remote: int) -> None:
        """That connection closed; it stays ours for ``linger_seconds``."""
        pair = (local, remote)
        with self._lock:
            left = self._open.get(pair, 0) - 1
            if left > 0:
                self._open[pair] = left
                return
            self._open.pop(pair, None)
            self._closed[pair] = self._clock()
            crowded = len(self._closed) > 1024
        if crowded:
            self.pairs()  # bounded even in a process where no collector reads the registry each tick

    def pairs(self) -> frozenset[Pair]:
        """Pairs to leave out now. Expired ones are forgotten (and listeners told)."""
        now = self._clock()
        with self._lock:
            expired = [p for p, at in self._closed.items() if now - at >= self.linger_seconds]
            for pair in expired:
                del self._closed[pair]
            current = frozenset(self._open) | frozenset(self._closed)
            listeners = list(self._listeners)
        for pair in expired:
            for listener in listeners:
                listener(pair, False)
        return current

    def subscribe(self, listener: Callable[[Pair, bool], None]) -> Callable[[], None]:
        """``listener(pair, added)`` on every registration and expiry, called at once with the
        pairs held now; returns a function that unsubscribes."""
        with self._lock:
            self._listeners.append(listener)
            held = list(self._open) + list(self._closed)
        for pair in held:
            listener(pair, True)

        def unsubscribe() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return unsubscribe


#: The process's registry: the engine collector's connections register here; the tcp and
#: timewait collectors read it.
OWN_PORTS = OwnPorts()


def bound_connection(
    address: tuple[str, int],
    timeout: float | None = None,
    source_address: tuple[str, int] | None = None,
    *,
    registry: OwnPorts = OWN_PORTS,
) -> socket.socket:
    """``socket.create_connection`` that binds the local port first and registers it in
    ``registry`` before connecting, so the handshake itself is already known as ours."""
    host, port = address
    error: OSError | None = None
    for family, kind, proto, _, target in socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        local = None
        try:
            if timeout is not None:
                sock.settimeout(timeout)
            bind_host = source_address[0] if source_address else ("::" if family == socket.AF_INET6 else "0.0.0.0")
            sock.bind((bind_host, source_address[1] if source_address else 0))
            local = sock.getsockname()[1]
            registry.add(local, port)
            sock.connect(target)
            return sock
        except OSError as exc:
            error = exc
            if local is not None:
                registry.release(local, port)
            sock.close()
    raise error if error is not None else OSError(f"getaddrinfo returned nothing for {host!r}")

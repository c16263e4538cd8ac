"""dump_tcp on real loopback sockets: one request for both families, counts read from the raw messages."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import pytest

from llmdiag.collectors import sockdiag
from llmdiag.collectors.sockdiag import TCP_STATES, dump_tcp


def port_range() -> range:
    low, high = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    return range(low, high + 1)


@contextmanager
def connections(n: int) -> Iterator[tuple[socket.socket, list[socket.socket], list[socket.socket]]]:
    """A listener on a port below the ephemeral range and ``n`` accepted loopback connections."""
    with ExitStack() as stack:
        server = stack.enter_context(socket.socket())
        # A port with no TIME_WAIT towards it left from an earlier run: those expire while a test
        # counts, and would make its differences wrong.
        lingering = dump_tcp(("TIME_WAIT",), families=(socket.AF_INET,))
        for port in range(port_range().start - 1, 1023, -1):
            if f"127.0.0.1:{port}" in lingering:
                continue
            try:
                server.bind(("127.0.0.1", port))
                break
            except OSError:
                continue
        else:
            pytest.skip("no free port below the ephemeral range")
        server.listen(n)
        clients, accepted = [], []
        for _ in range(n):
            clients.append(stack.enter_context(socket.create_connection(server.getsockname(), timeout=5)))
            accepted.append(stack.enter_context(server.accept()[0]))
        yield server, clients, accepted


def endpoint(sock: socket.socket, peer: bool = False) -> str:
    host, port = sock.getpeername() if peer else sock.getsockname()
    return f"{host}:{port}"


def test_both_families_in_one_request_match_one_request_per_family() -> None:
    ephemeral = port_range()
    states = ("ESTABLISHED", "TIME_WAIT")
    with connections(3) as (server, _clients, _accepted), socket.socket(socket.AF_INET6) as six:
        six.bind(("::1", 0))
        six.listen(1)
        with socket.create_connection(six.getsockname()[:2], timeout=5) as c6, six.accept()[0]:
            both = dump_tcp(states, ephemeral=ephemeral)  # the default: AF_UNSPEC, one walk
            v4 = dump_tcp(states, families=(socket.AF_INET,), ephemeral=ephemeral)
            v6 = dump_tcp(states, families=(socket.AF_INET6,), ephemeral=ephemeral)
            dest4, dest6 = endpoint(server), f"[::1]:{six.getsockname()[1]}"
            assert both[dest4].other_ephemeral == v4[dest4].other_ephemeral == 3
            assert dest6 not in v4 and both[dest6].other_ephemeral == v6[dest6].other_ephemeral == 1
            assert c6.getsockname()[1] in ephemeral
            # Every connection's server side (local port below the range) is seen but not counted.
            for c in _clients:
                assert both[endpoint(c)].other_ephemeral == 0 and both[endpoint(c)].timewait == 0


def test_timewait_counts_ages_and_exclusions_read_from_the_raw_messages() -> None:
    def count(**kw: object) -> tuple[int, int]:
        entry = dump_tcp(("TIME_WAIT",), families=(socket.AF_INET,), **kw).get(dest)  # type: ignore[arg-type]
        return (entry.timewait, entry.timewait_recent) if entry else (0, 0)

    with connections(3) as (server, clients, accepted):
        dest = endpoint(server)
        before = count(recent_ms=10_000)  # an earlier run's TIME_WAIT towards the same port, if any
        ports = [c.getsockname()[1] for c in clients]
        for c in clients:
            c.close()  # the client closes first: its side will hold TIME_WAIT towards dest...
        for a in accepted:
            a.close()  # ...once the server's FIN arrives
        server_port = server.getsockname()[1]
        deadline = time.monotonic() + 5
        fresh = count(recent_ms=10_000)
        while fresh[0] - before[0] < 3 and time.monotonic() < deadline:  # the last ACKs may still be in softirq
            time.sleep(0.02)
            fresh = count(recent_ms=10_000)
        assert (fresh[0] - before[0], fresh[1] - before[1]) == (3, 3)  # timers near 60 s: entered < 10 s ago
        assert count(recent_ms=0)[1] == 0  # no timer is above 60 s
        mine = frozenset({(ports[0], server_port)})
        assert count(exclude=mine)[0] == fresh[0] - 1
        # The same from the full message parse, socket by socket.
        mask = 1 << TCP_STATES["TIME_WAIT"]
        ours = [s for s in sockdiag._dump(socket.AF_INET, mask) if s[3] in ports and s[2] == server_port]
        assert sorted(s[3] for s in ours) == sorted(ports)
        assert all(50_000 < s[5] <= 60_000 for s in ours)

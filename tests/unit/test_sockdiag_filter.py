"""dump_tcp's in-kernel filter: the local-port bytecode keeps exactly the sockets Python would have counted."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import pytest

from llmdiag.collectors import sockdiag
from llmdiag.collectors.sockdiag import TCP_STATES, dump_tcp, local_port_filter


def port_range() -> range:
    low, high = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    return range(low, high + 1)


@contextmanager
def connections(n: int) -> Iterator[tuple[socket.socket, list[socket.socket], list[socket.socket]]]:
    """A listener on a port below the ephemeral range and ``n`` accepted loopback connections."""
    with ExitStack() as stack:
        server = stack.enter_context(socket.socket())
        for port in range(port_range().start - 1, 1023, -1):
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


def test_the_bytecode_is_what_ss_compiles() -> None:
    # ss -tan 'sport >= :32768 and sport <= :60999': S_GE yes 8 no 20, port; S_LE yes 8 no 12, port.
    assert local_port_filter(32768, 60999) == bytes([2, 8, 20, 0, 0, 0, 0x00, 0x80, 3, 8, 12, 0, 0, 0, 0x47, 0xEE])


def test_kernel_filter_counts_the_client_side_and_drops_the_server_side() -> None:
    ephemeral = port_range()
    with connections(3) as (server, clients, _accepted):
        dest = endpoint(server)
        per_dest = dump_tcp(("ESTABLISHED", "TIME_WAIT"), families=(socket.AF_INET,), ephemeral=ephemeral)
        assert per_dest[dest].other_ephemeral == 3
        # The accepted (server) sides, local port below the range, never left the kernel.
        for c in clients:
            assert endpoint(c) not in per_dest
        # ...while an unfiltered dump does see them: the filter, not their absence, left them out.
        mask = 1 << TCP_STATES["ESTABLISHED"]
        remotes = {sockdiag.format_endpoint(f, d, p) for _s, d, p, _sp, f, _e, _src in sockdiag._dump(socket.AF_INET, mask)}
        assert {endpoint(c) for c in clients} <= remotes
        # A range that leaves the clients' ports out counts none of them.
        ports = sorted(c.getsockname()[1] for c in clients)
        below = range(ephemeral.start, ports[0])
        if len(below):
            narrow = dump_tcp(("ESTABLISHED",), families=(socket.AF_INET,), ephemeral=below)
            assert dest not in narrow or narrow[dest].other_ephemeral == 0
        # Without an ephemeral range the non-TIME_WAIT states count nothing, so they are not dumped.
        assert dest not in dump_tcp(("ESTABLISHED",), families=(socket.AF_INET,))


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

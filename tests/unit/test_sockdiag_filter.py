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
def connections(n: int) -> Iterator[tuple[socket.socket, list[socket.socket]]]:
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
        clients = []
        for _ in range(n):
            c = stack.enter_context(socket.create_connection(server.getsockname(), timeout=5))
            stack.enter_context(server.accept()[0])
            clients.append(c)
        yield server, clients


def endpoint(sock: socket.socket, peer: bool = False) -> str:
    host, port = sock.getpeername() if peer else sock.getsockname()
    return f"{host}:{port}"


def test_the_bytecode_is_what_ss_compiles() -> None:
    # ss -tan 'sport >= :32768 and sport <= :60999': S_GE yes 8 no 20, port; S_LE yes 8 no 12, port.
    assert local_port_filter(32768, 60999) == bytes([2, 8, 20, 0, 0, 0, 0x00, 0x80, 3, 8, 12, 0, 0, 0, 0x47, 0xEE])


def test_kernel_filter_counts_the_client_side_and_drops_the_server_side() -> None:
    ephemeral = port_range()
    with connections(3) as (server, clients):
        dest = endpoint(server)
        per_dest = dump_tcp(("ESTABLISHED", "TIME_WAIT"), families=(socket.AF_INET,), ephemeral=ephemeral)
        assert per_dest[dest].other_ephemeral == 3 and per_dest[dest].timewait == 0
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

"""The bcc loader on the running kernel: compile, auto-attach, count real loopback
connections, count map-full failures, detach (SPEC section 2)."""

from __future__ import annotations

import socket
import time

import pytest

from llmdiag.bpf import features
from llmdiag.bpf.loader import AttachPoint, BPFUnavailable, Program, choose

pytestmark = pytest.mark.root

# TCP states (include/net/tcp_states.h)
ESTABLISHED, SYN_SENT, SYN_RECV, FIN_WAIT1, FIN_WAIT2, CLOSE, CLOSE_WAIT, LAST_ACK = 1, 2, 3, 4, 5, 7, 8, 9


def _listener() -> socket.socket:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(128)
    return srv


def _connect_and_close(srv: socket.socket, count: int) -> None:
    port = srv.getsockname()[1]
    for _ in range(count):
        client = socket.create_connection(("127.0.0.1", port))
        server_side, _ = srv.accept()
        client.close()  # the client closes first: it is the active closer
        server_side.close()


def _transitions(prog: Program) -> dict[tuple[int, int], int]:
    return {(key >> 8, key & 0xFF): value for key, value in prog.read_hash("transitions")}


def _wait_for(predicate, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)


def test_selftest_counts_real_loopback_connections() -> None:
    with _listener() as srv:
        port = srv.getsockname()[1]
        prog = Program.load("selftest", {"SELFTEST_PORT": port})
        try:
            assert "tracepoint:sock:inet_sock_set_state" in prog.attached
            _connect_and_close(srv, 25)
            _wait_for(lambda: _transitions(prog).get((LAST_ACK, CLOSE), 0) >= 25)
            counts = _transitions(prog)
            errors = prog.errors()
        finally:
            prog.close()
    assert counts[(CLOSE, SYN_SENT)] == 25  # client connect()
    assert counts[(SYN_SENT, ESTABLISHED)] == 25
    assert counts[(SYN_RECV, ESTABLISHED)] == 25  # server side handshake done
    assert counts[(ESTABLISHED, FIN_WAIT1)] == 25  # client closes first
    assert counts[(ESTABLISHED, CLOSE_WAIT)] == 25  # server sees the peer close
    assert counts[(LAST_ACK, CLOSE)] == 25
    assert errors["map_full"] == 0


def test_map_full_failures_are_counted() -> None:
    with _listener() as srv:
        prog = Program.load("selftest", {"SELFTEST_PORT": srv.getsockname()[1], "MAX_TRANSITIONS": 2})
        try:
            _connect_and_close(srv, 5)
            _wait_for(lambda: prog.errors()["map_full"] >= 5 * 10 - 2)
            assert len(_transitions(prog)) == 2
            # 10 transitions per connection (5 per side); only 2 distinct keys fit.
            assert sum(_transitions(prog).values()) + prog.errors()["map_full"] == 50
        finally:
            prog.close()


def test_close_detaches_and_is_idempotent() -> None:
    with _listener() as srv:
        prog = Program.load("selftest", {"SELFTEST_PORT": srv.getsockname()[1]})
        table = prog.table("transitions")
        prog.close()
        prog.close()
        assert prog.closed and prog.attached == []
        assert prog.bpf.num_open_tracepoints() == 0
        del table


def test_attach_point_choice_prefers_what_the_kernel_has() -> None:
    candidates = [
        AttachPoint("tracepoint", "tcp:no_such_tracepoint", "f"),
        AttachPoint("kprobe", "tcp_sendmsg", "f"),
        AttachPoint("tracepoint", "sock:sock_send_length", "f"),
    ]
    chosen = choose(candidates)
    if features.kprobes_supported():
        assert chosen is not None and chosen.kind == "kprobe"
    else:
        assert chosen == candidates[2]


def test_compile_error_is_bpf_unavailable_with_reason() -> None:
    with pytest.raises(BPFUnavailable) as info:
        Program.load("selftest", {"SELFTEST_PORT": "undefined_identifier_xyz"})
    assert "undefined_identifier_xyz" in info.value.reason
    assert info.value.hint

"""llmdiag's own scrape sockets are never counted against a backend (real loopback sockets, sock_diag)."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from engine_http import ScriptedServer  # noqa: E402

from llmdiag.collectors.http_fetch import KeepAlivePool, http_get  # noqa: E402
from llmdiag.collectors.own_sockets import OWN_PORTS  # noqa: E402
from llmdiag.collectors.sockdiag import dump_tcp  # noqa: E402
from llmdiag.collectors.timewait import TimewaitCollector  # noqa: E402
from llmdiag.model import Backend, Snapshot  # noqa: E402

pytestmark = pytest.mark.root

# Small enough that a client reads it in one recv (closing with unread data sends RST, not FIN).
BODY = "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine=\"0\"} 1.0\n"


def _timewait(server_port: int, client_ports: set[int], exclude: frozenset[tuple[int, int]]) -> int:
    """TIME_WAIT sockets on either end of the connections between these ports: the client's
    (towards 127.0.0.1:server_port) or the server's (towards 127.0.0.1:client_port)."""
    per_dest = dump_tcp(("TIME_WAIT",), exclude=exclude)
    keys = [f"127.0.0.1:{server_port}"] + [f"127.0.0.1:{p}" for p in client_ports]
    return sum(per_dest[k].timewait for k in keys if k in per_dest)


def test_one_shot_scrapes_leave_timewait_that_is_not_counted_as_anyones() -> None:
    with ScriptedServer({"/metrics": [BODY]}) as server:
        for _ in range(3):
            assert http_get(f"{server.url}/metrics", 2.0, 1 << 22).status == 200
        ours = set(server.peers)
    # Whichever end closed first holds each TIME_WAIT: the kernel has three.
    assert _timewait(server.port, ours, frozenset()) == 3
    assert _timewait(server.port, ours, OWN_PORTS.pairs()) == 0


def test_kept_alive_scrapes_and_the_close_at_exit_are_not_blamed_on_the_backend() -> None:
    with ScriptedServer({"/metrics": [BODY]}, keep_alive=True) as server:
        pool = KeepAlivePool()
        for _ in range(5):
            assert pool(f"{server.url}/metrics", 2.0, 1 << 22).status == 200
        pool.close()  # we close first: the TIME_WAIT is ours, towards the backend's ip:port
        port = server.port
        # A foreign client that closes first leaves TIME_WAIT that does count.
        other = socket.create_connection(("127.0.0.1", port), timeout=5)
        other.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while not answer.endswith(b"1.0\n"):  # read it all: closing with unread data would send RST
            answer += other.recv(1 << 16)
        other.close()
        deadline = time.monotonic() + 5
        while _timewait(port, set(), frozenset()) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)  # the server answers the FIN from its handler thread
        timewait = TimewaitCollector(backends=[Backend.from_url(server.url, name="b0")])
        snap = Snapshot(ts=1.0)
        snap.extend(timewait.collect(1.0))
    assert len(set(server.peers)) == 2  # five scrapes on one connection, plus the foreign client
    assert _timewait(port, set(), frozenset()) == 2  # the kernel has both clients' TIME_WAIT
    assert snap.destinations[f"127.0.0.1:{port}"]["timewait_sockets"] == 1  # only the foreign one is counted

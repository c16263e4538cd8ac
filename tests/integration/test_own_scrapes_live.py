"""A real ``llmdiag collect`` against a real fake engine: its scrapes leave no TIME_WAIT per
scrape and are never counted as the backend's connections or churn."""

from __future__ import annotations

import json
import time

import pytest
from conftest import root_unavailable_reason
from live_engine import llmdiag_process, loaded_engine, tcp_ports_of

from llmdiag.collectors.sockdiag import iter_tcp

pytestmark = [pytest.mark.integration, pytest.mark.root]


def _timewait_between(port: int, clients: set[int]) -> list[tuple[int, str]]:
    """TIME_WAIT sockets on either end of connections between 127.0.0.1:``port`` and these client ports."""
    return [
        (lport, remote)
        for _s, lport, remote, _local in iter_tcp(("TIME_WAIT",))
        if (lport in clients and remote == f"127.0.0.1:{port}") or (lport == port and int(remote.rsplit(":", 1)[1]) in clients)
    ]


def test_collect_leaves_no_timewait_per_scrape_and_blames_no_churn(tmp_path) -> None:
    assert root_unavailable_reason() is None
    with loaded_engine("", rps=0) as engine:  # no load of our own: the engine's clients are llmdiag (and others')
        port = int(engine.url.rsplit(":", 1)[1])
        proc = llmdiag_process("--backend", engine.url, "collect", "--duration", "6", "--collectors",
                               "engine,timewait,tcp", "--json", cwd=tmp_path)
        # Other processes on this host may scrape the engine too (agents discovering engines):
        # the collect's own connections are the sockets its pid holds towards the engine.
        ours: set[int] = set()
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            ours |= tcp_ports_of(proc.pid, port)
            time.sleep(0.2)
        stdout, stderr = proc.communicate(timeout=30)
        time.sleep(0.3)
        scrapes = [client for client, _connection in engine.metrics_requests if client in ours]
        foreign = len({client for client, _connection in engine.metrics_requests if client not in ours})
        timewait = _timewait_between(port, ours)
    assert proc.returncode == 0, stderr
    snapshots = [json.loads(line) for line in stdout.splitlines()]
    assert len(snapshots) >= 5
    (name,) = snapshots[-1]["backends"]
    assert all(s["backends"][name]["up"] == 1 for s in snapshots)
    # Every scrape on one kept-alive connection: at most its close at exit leaves a TIME_WAIT
    # (one per scrape before), and none of it is counted against the backend.
    assert len(ours) == 1 and len(scrapes) >= 5, (ours, scrapes)  # one connection served every scrape
    assert len(timewait) <= 1 and all(lport in scrapes for lport, _ in timewait), timewait
    # Nothing of llmdiag's own is counted: with no other client (CI) every count is 0; on a shared
    # host, other processes' connections to the engine (``foreign``) are real clients and count.
    destination = f"127.0.0.1:{port}"
    assert all(s["host"]["destinations"][destination]["timewait_sockets"] <= foreign for s in snapshots)
    last = snapshots[-1]["backends"][name]
    assert last["tcp_active_closes_total"] <= foreign and last["tcp_peer_closes_total"] <= foreign
    assert last["tcp_connections_active"] <= foreign  # the scrape connection is open, and not the backend's load

"""A real ``llmdiag collect`` against a real fake engine: its scrapes leave no TIME_WAIT per
scrape and are never counted as the backend's connections or churn."""

from __future__ import annotations

import json
import time

import pytest
from conftest import root_unavailable_reason
from live_engine import llmdiag, loaded_engine

from llmdiag.collectors.sockdiag import iter_tcp

pytestmark = [pytest.mark.integration, pytest.mark.root]


def _timewait_on(port: int) -> list[tuple[int, str]]:
    """TIME_WAIT sockets on either end of connections to ``port`` on this host."""
    return [(lport, remote) for _s, lport, remote in iter_tcp(("TIME_WAIT",)) if lport == port or remote.endswith(f":{port}")]


def test_collect_leaves_no_timewait_per_scrape_and_blames_no_churn(tmp_path) -> None:
    assert root_unavailable_reason() is None
    with loaded_engine("", rps=0) as engine:  # no clients: every socket on its port is llmdiag's
        port = int(engine.url.rsplit(":", 1)[1])
        before = _timewait_on(port)
        run = llmdiag("--backend", engine.url, "collect", "--duration", "6", "--collectors", "engine,timewait,tcp",
                      "--json", cwd=tmp_path, timeout=120)
        time.sleep(0.3)
        after = _timewait_on(port)
    assert run.returncode == 0, run.stderr
    snapshots = [json.loads(line) for line in run.stdout.splitlines()]
    assert len(snapshots) >= 5
    (name,) = snapshots[-1]["backends"]
    assert all(s["backends"][name]["up"] == 1 for s in snapshots)
    # Six scrapes on one kept-alive connection: at most the one close at exit leaves a TIME_WAIT
    # (one per scrape before), and none of it is counted against the backend.
    assert len(after) - len(before) <= 1, (before, after)
    destination = f"127.0.0.1:{port}"
    assert all(s["host"]["destinations"][destination]["timewait_sockets"] == 0 for s in snapshots)
    last = snapshots[-1]["backends"][name]
    assert last["tcp_active_closes_total"] == 0 and last["tcp_peer_closes_total"] == 0
    assert last["tcp_connections_active"] == 0  # the scrape connection is open, and not the backend's load

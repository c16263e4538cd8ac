"""``llmdiag agent`` end to end as a user types it; backends that appear later or restart."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent_support import AgentProcess, agent_check, fake_engines, free_port, http, llmdiag, stop, wait_for

pytestmark = pytest.mark.integration


@pytest.mark.root
def test_the_command_line_as_typed_with_every_collector(tmp_path: Path) -> None:
    """Defaults (1 s ticks, all collectors: BPF compiled and attached once), two --backend URLs."""
    with fake_engines([[], []]) as urls:
        agent = AgentProcess(["--backend", urls[0], "--backend", urls[1]], tmp_path)
        try:
            agent.wait_ready(ticks=2, timeout=120)
            doc = agent.penalties()
            names = {b["name"]: b for b in doc["backends"]}
            assert set(names) == {u.removeprefix("http://") for u in urls}
            assert all(b["address"] == name for name, b in names.items())
            state = agent.state()
            assert state["collectors"]["tcp"]["status"] in ("ok", "degraded"), state["collectors"]["tcp"]
            assert state["collectors"]["engine"]["status"] == "ok"
            assert agent.check_port is not None
            reply = agent_check(agent.check_port, urls[0].removeprefix("http://").encode() + b"\n")
            assert reply.startswith("ready up ") and reply.endswith("%\n"), reply
            assert "agent-check 127.0.0.1:" in agent.log()
        finally:
            code, log, took = agent.stop()
        assert code == 0, log
        assert took < 5, f"SIGTERM took {took:.1f} s\n{log}"


def test_usage_errors_exit_64(tmp_path: Path) -> None:
    for argv in (["agent", "--listen", "9464"], ["agent", "--agent-check", "localhost"],
                 ["agent", "--token-file", str(tmp_path / "missing")], ["agent", "--interval", "0"]):
        proc = llmdiag(*argv)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 64, (argv, out)
        assert "Traceback" not in out, out
    (tmp_path / "bad.toml").write_text('[agent]\ncollectors = ["nosuch"]\n')
    proc = llmdiag("--config", str(tmp_path / "bad.toml"), "agent")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 64 and "nosuch" in out, out


def test_engines_that_appear_later_or_restart_are_picked_up(tmp_path: Path) -> None:
    late_port = free_port()
    config = f"""
[agent]
interval_seconds = 0.3
discover_interval_seconds = 0.5
collectors = ["engine", "proc"]

[balancer]
probe_ejected_interval_seconds = 0.5

[[backends]]
name = "late"
url = "http://127.0.0.1:{late_port}"
"""
    agent = AgentProcess([], tmp_path, config=config, agent_check=False)
    try:
        agent.wait_ready(ticks=2)
        assert agent.state()["snapshot"]["backends"]["late"]["up"] == 0  # not started yet

        def backend(state_name: str) -> dict | None:
            b = agent.state()["backends"].get("late")
            return b if b is not None and b["state"] == state_name else None

        with _engine(late_port):
            wait_for("the late engine to be up", lambda: agent.state()["snapshot"]["backends"]["late"]["up"] == 1, 20, 0.3)
            wait_for("the late engine to finish warming up", lambda: backend("healthy"), 30, 0.3)
        # The engine stops and a new process (new pid, counters from zero) takes the port.
        wait_for("the stopped engine to be seen down", lambda: agent.state()["snapshot"]["backends"]["late"]["up"] == 0,
                 20, 0.3)
        with _engine(late_port):
            # Picked up without restarting the agent: its new pid is noticed, the engine comes back
            # through the breaker and ramps up again instead of jumping to full weight.
            seen: list[tuple[str, float]] = []

            def back_and_healthy() -> bool:
                b = agent.state()["backends"]["late"]
                seen.append((b["state"], b["score"]))
                return b["state"] == "healthy" and any(s != "healthy" for s, _ in seen)

            wait_for("the restarted engine to be healthy again", back_and_healthy, 40, 0.2)
            assert agent.state()["snapshot"]["backends"]["late"]["up"] == 1
            assert any(state in ("warming", "half_open", "ejected") for state, _ in seen), seen
            assert min(score for _, score in seen) < 50, seen
        wait_for("the restart in the log", lambda: "restarted" in agent.log(), 10, 0.2)
        assert http(agent.url + "/healthz")[0] == 200
    finally:
        code, log, took = agent.stop()
    assert code == 0 and took < 5, log


@contextlib.contextmanager
def _engine(port: int) -> Iterator[None]:
    """One fake engine process on a given port."""
    proc = llmdiag("fake-engine", "--port", str(port), stdout=subprocess.DEVNULL)
    try:
        wait_for("the engine to listen", lambda: http(f"http://127.0.0.1:{port}/metrics")[0] == 200, 20, 0.2)
        yield
    finally:
        stop(proc)


def test_discovery_finds_an_engine_started_after_the_agent(tmp_path: Path) -> None:
    config = """
[agent]
interval_seconds = 0.3
discover_interval_seconds = 0.5
collectors = ["engine"]
probes = false
"""
    agent = AgentProcess([], tmp_path, config=config, agent_check=False)
    try:
        agent.wait_ready(ticks=2)
        with fake_engines([[]]) as (url,):
            address = url.removeprefix("http://")

            def found() -> bool:
                return any(b["address"] == address for b in agent.state()["backends"].values())

            wait_for("discovery to find the new engine", found, 30, 0.3)
            time.sleep(0.5)
            state = agent.state()
            name = next(n for n, b in state["backends"].items() if b["address"] == address)
            assert state["snapshot"]["backends"][name]["up"] == 1
    finally:
        code, log, took = agent.stop()
    assert code == 0 and took < 5, log


def test_a_config_a_collector_rejects_exits_64(tmp_path: Path) -> None:
    """A bad input file for a collector ([gpu] replay_file) is the user's mistake: exit 64, named, no traceback."""
    agent = AgentProcess([], tmp_path, agent_check=False,
                         config=f'[agent]\ndiscover = false\ncollectors = ["gpu"]\n[gpu]\nreplay_file = "{tmp_path / "nope.jsonl"}"\n')
    try:
        code = agent.proc.wait(timeout=60)
    finally:
        _, log, _ = agent.stop()
    assert code == 64, log
    assert "nope.jsonl" in log and "Traceback" not in log, log

"""A real HAProxy 2.6 in front of fake engines, weighted by ``llmdiag agent`` over agent-check.

One engine (``vllm-2``) goes bad under load: its KV cache shrinks and its steps slow down
(a throttled GPU), with a small queue limit so that it answers 429 "saturated" once its
queue fills; later it crashes and restarts. Read from HAProxy's own ``show servers state``:

* its weight falls below the healthy engines' weights (its queue, TTFT and errors lower its score);
* it is put in ``drain`` while cooling (a saturation answer to the agent's probe);
* it is marked ``down`` while ejected (probes refused during the crash);
* after the restart its weight climbs back with the warm-up ramp.

Wall time about a minute (the fault needs load to build a queue).
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent_support import AgentProcess, agent_check, fake_engines, free_port, stop, wait_for

from llmdiag.sim.demo_fleet import LoadStats, run_load

pytestmark = pytest.mark.integration

FAULT_AT, CRASH_AT, DOWN_FOR = 6, 30, 6
CONFIG = """
[agent]
interval_seconds = 0.5
discover = false
collectors = ["engine", "proc"]

[balancer]
probe_interval_seconds = 0.5
probe_ejected_interval_seconds = 0.5
probe_timeout_seconds = 5.0

[[backends]]
name = "vllm-0"
url = "{0}"
engine = "vllm"

[[backends]]
name = "vllm-1"
url = "{1}"
engine = "vllm"

[[backends]]
name = "vllm-2"
url = "{2}"
engine = "vllm"
"""
ENGINE = ["--profile", "llama-70b-a100-tp8", "--kv-capacity", "60000", "--model", "fake/llama-70b"]
BAD = [*ENGINE, "--queue-limit", "1", "--faults",
       f"kv_shrink:start={FAULT_AT},duration={CRASH_AT - FAULT_AT},factor=0.25;"
       f"slowdown:start={FAULT_AT},duration={CRASH_AT - FAULT_AT},speed=0.35;"
       f"crash:start={CRASH_AT},down={DOWN_FOR},warmup_s=0"]


@dataclass(frozen=True)
class ServerState:
    t: float
    name: str
    op_state: int  # 0 stopped (down), 2 running
    admin_state: int  # bit 0x08: forced drain (agent "drain")
    weight: int  # srv_uweight: the agent's percentage of the configured weight 100

    @property
    def drained(self) -> bool:
        return bool(self.admin_state & 0x08)

    @property
    def down(self) -> bool:
        return self.op_state == 0


def show_servers_state(sock_path: Path, start: float) -> list[ServerState]:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(2)
        s.connect(str(sock_path))
        s.sendall(b"show servers state llm\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    lines = data.decode().splitlines()
    header = next(line for line in lines if line.startswith("# be_id")).lstrip("# ").split()
    col = {name: i for i, name in enumerate(header)}
    now = time.monotonic() - start
    out = []
    for line in lines:
        parts = line.split()
        if not parts or line.startswith("#") or len(parts) < len(header) - 2 or parts[0] == "1" and len(parts) == 1:
            continue
        out.append(ServerState(now, parts[col["srv_name"]], int(parts[col["srv_op_state"]]),
                               int(parts[col["srv_admin_state"]]), int(parts[col["srv_uweight"]])))
    return out


def test_haproxy_follows_the_agent_through_fault_drain_down_and_recovery(tmp_path: Path) -> None:
    specs = [ENGINE, ENGINE, BAD]
    with fake_engines(specs) as urls:
        start = time.monotonic()  # the engines' fault clocks started just now
        agent = AgentProcess([], tmp_path, config=CONFIG.format(*urls))
        fe_port = free_port()
        sock = tmp_path / "haproxy.sock"
        servers = "\n".join(
            f"    server vllm-{i} {url.removeprefix('http://')} weight 100 agent-check agent-addr 127.0.0.1 "
            f"agent-port {agent.check_port} agent-inter 250ms agent-send \"llm/vllm-{i}\\n\""
            for i, url in enumerate(urls))
        cfg = tmp_path / "haproxy.cfg"
        cfg.write_text(f"""global
    stats socket {sock} mode 600 level admin
    maxconn 2000
defaults
    mode http
    timeout connect 2s
    timeout client 60s
    timeout server 60s
frontend fe
    bind 127.0.0.1:{fe_port}
    default_backend llm
backend llm
    balance roundrobin
{servers}
""")
        check = subprocess.run(["haproxy", "-c", "-f", str(cfg)], capture_output=True, text=True, timeout=30)
        assert check.returncode == 0, check.stdout + check.stderr
        haproxy = subprocess.Popen(["haproxy", "-f", str(cfg), "-db"], stdout=subprocess.DEVNULL,
                                   stderr=(tmp_path / "haproxy.log").open("w"))
        stop_load = threading.Event()
        stats = LoadStats()

        def load() -> None:
            async def main() -> None:
                done = asyncio.Event()

                async def watch() -> None:
                    while not stop_load.is_set():
                        await asyncio.sleep(0.1)
                    done.set()

                watcher = asyncio.create_task(watch())
                await run_load([f"http://127.0.0.1:{fe_port}"], "fake/llama-70b", 4.0, CRASH_AT + DOWN_FOR + 40,
                               client_timeout_s=10.0, stats=stats, stop=done)
                watcher.cancel()

            asyncio.run(main())

        loader = threading.Thread(target=load, daemon=True)
        history: list[ServerState] = []
        try:
            agent.wait_ready()
            wait_for("HAProxy's stats socket", sock.exists, 10)
            loader.start()

            def record_until(t_end: float, done: callable = lambda h: False) -> None:  # type: ignore[valid-type]
                while time.monotonic() - start < t_end:
                    history.extend(show_servers_state(sock, start))
                    if done(history):
                        return
                    time.sleep(0.25)

            def bad(h: list[ServerState]) -> list[ServerState]:
                return [s for s in h if s.name == "vllm-2"]

            # 1. The fault: vllm-2's weight falls below the healthy engines' (before the crash).
            def fell(h: list[ServerState]) -> bool:
                by_t: dict[float, dict[str, ServerState]] = {}
                for s in h:
                    by_t.setdefault(s.t, {})[s.name] = s
                return any(len(v) == 3 and not v["vllm-2"].down and not v["vllm-2"].drained
                           and v["vllm-2"].weight + 20 <= min(v["vllm-0"].weight, v["vllm-1"].weight) for v in by_t.values())

            record_until(CRASH_AT, fell)
            assert fell(history), _story(history) + "\n" + agent.log()[-3000:] + str(agent.penalties())
            # 2. Drain while cooling (a 429 "saturated" answer to a probe), seen before the crash.
            record_until(CRASH_AT, lambda h: any(s.drained for s in bad(h)))
            assert any(s.drained and not s.down for s in bad(history)), _story(history)
            # 3. Down while ejected (the crash refuses the probes).
            record_until(CRASH_AT + DOWN_FOR + 5, lambda h: any(s.down for s in bad(h)))
            downs = [s for s in bad(history) if s.down]
            assert downs, _story(history)
            # 4. After the restart the weight climbs back with the ramp (to where the slow engine stood
            # before its crash at least: its TTFT history still weighs on its score for a while).
            record_until(CRASH_AT + DOWN_FOR + 30,
                         lambda h: any(s.weight >= 50 and s.t > downs[-1].t and not s.down for s in bad(h)))
            after = [s for s in bad(history) if s.t > downs[-1].t and not s.down and not s.drained]
            assert after and max(s.weight for s in after) >= 50, _story(history)
            climb = sorted({s.weight for s in after})
            assert len(climb) >= 3, f"the weight should ramp, not jump: {climb}\n" + _story(history)
            # The healthy engines were never taken out.
            assert not [s for s in history if s.name != "vllm-2" and (s.down or s.drained)], _story(history)
            # The same port also answers by ip:port, and an unknown name fails open.
            assert agent_check(agent.check_port, f"{urls[0].removeprefix('http://')}\n".encode()).startswith("ready up ")
            assert agent_check(agent.check_port, b"llm/nosuch\n") == "ready up 100%\n"
        finally:
            stop_load.set()
            loader.join(timeout=15)
            stop(haproxy)  # type: ignore[arg-type]
            code, log, took = agent.stop()
        assert stats.statuses["200"] > 0, stats.statuses
        assert code == 0 and took < 5, log


def _story(history: list[ServerState]) -> str:
    """What HAProxy saw for vllm-2, compressed to the changes (for failure messages)."""
    out, last = [], None
    for s in history:
        if s.name != "vllm-2":
            continue
        key = (s.op_state, s.admin_state, s.weight)
        if key != last:
            out.append(f"t={s.t:5.1f}s op={s.op_state} admin={s.admin_state} weight={s.weight}")
            last = key
    return "\n".join(out[-80:])

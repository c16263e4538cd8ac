"""deploy/haproxy/haproxy.cfg wired for real: one HAProxy, two "nodes", each server checked by its node's agent.

The example's backend section is kept as shipped (balance, health check, ``default-server`` with
``agent-check``/``agent-inter``); its servers are rewritten onto loopback: fake engines on
127.0.0.1 and one ``llmdiag agent`` per "node" on 127.0.0.2 and 127.0.0.3, each watching only
its node's engines, with ``agent-addr`` pointing at the agent of the server's node and
``agent-send`` naming the server's address, as the example does. HAProxy's agent checks must
then reach the right agent for every server: each agent answers only for its own engines
(``result="ok"``), is never asked about another node's engine, and HAProxy reports every server's agent check as
passed, with the weight the agent gave.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "deploy" / "haproxy" / "haproxy.cfg"
SERVER_RE = re.compile(r'^\s*server (\S+) (\S+) agent-addr (\S+) agent-send "(\S+)\\n"\s*$')


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_http(url: str, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:  # noqa: S310 - loopback
                resp.read()
                return
        except OSError:
            if time.monotonic() > end:
                raise
            time.sleep(0.2)


def haproxy_cmd(sock: Path, command: str) -> str:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(str(sock))
        s.sendall(command.encode() + b"\n")
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks).decode()


def test_example_servers_name_their_own_address_to_their_nodes_agent():
    servers = [SERVER_RE.match(line) for line in EXAMPLE.read_text().splitlines() if line.strip().startswith("server ")]
    assert servers and all(servers), "every server line: server NAME ADDR agent-addr NODE_IP agent-send \"ADDR\\n\""
    for m in servers:
        assert m.group(2) == m.group(4), f"{m.group(1)}: agent-send must name the server's own address"
    assert len({m.group(3) for m in servers}) >= 2, "the example spans several nodes"


def test_haproxy_checks_each_server_with_its_nodes_agent(tmp_path):
    haproxy = shutil.which("haproxy")
    if haproxy is None:
        pytest.fail("haproxy is missing: scripts/setup.sh installs it")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs: list[subprocess.Popen] = []
    try:
        engines = []
        for _ in range(3):
            port = free_port()
            procs.append(subprocess.Popen([sys.executable, "-m", "llmdiag.cli", "fake-engine", "--port", str(port)], env=env,
                                          cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            engines.append(f"127.0.0.1:{port}")
        for address in engines:
            wait_http(f"http://{address}/health", 20)
        # node A (127.0.0.2) runs engines 0 and 1, node B (127.0.0.3) engine 2
        nodes = {"127.0.0.2": engines[:2], "127.0.0.3": engines[2:]}
        agents = {}
        (tmp_path / "config.toml").write_text('[agent]\ncollectors = ["engine"]\n')
        for node_ip, mine in nodes.items():
            http_port, check_port = free_port(node_ip), free_port(node_ip)
            cmd = [sys.executable, "-m", "llmdiag.cli", "--config", str(tmp_path / "config.toml"), "agent",
                   "--listen", f"{node_ip}:{http_port}", "--agent-check", f"{node_ip}:{check_port}", "--interval", "0.5"]
            for address in mine:
                cmd += ["--backend", f"http://{address}"]
            procs.append(subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL,
                                          stderr=open(tmp_path / f"agent-{node_ip}.log", "w")))  # noqa: SIM115
            agents[node_ip] = (http_port, check_port)
        for node_ip, (http_port, _) in agents.items():
            wait_http(f"http://{node_ip}:{http_port}/healthz", 60)

        # The example, its three servers moved onto the loopback fleet (same names, same wiring rule).
        example_servers = [SERVER_RE.match(line) for line in EXAMPLE.read_text().splitlines()
                           if line.strip().startswith("server ")]
        placement = [(engines[0], "127.0.0.2"), (engines[1], "127.0.0.2"), (engines[2], "127.0.0.3")]
        lines, i = [], 0
        sock = tmp_path / "admin.sock"
        for line in EXAMPLE.read_text().splitlines():
            if line.strip().startswith("server "):
                name = example_servers[i].group(1)
                address, node_ip = placement[i]
                lines.append(f'    server {name} {address} agent-addr {node_ip} agent-port {agents[node_ip][1]} '
                             f'agent-send "{address}\\n"')
                i += 1
            elif line.strip().startswith("stats socket"):
                lines.append(f"    stats socket {sock} mode 600 level admin")
            elif line.strip().startswith("bind :8080"):
                lines.append(f"    bind 127.0.0.1:{free_port()}")
            elif line.strip().startswith("bind 127.0.0.1:8404"):
                lines.append(f"    bind 127.0.0.1:{free_port()}")
            else:
                lines.append(line)
        assert i == 3
        cfg = tmp_path / "haproxy.cfg"
        cfg.write_text("\n".join(lines) + "\n")
        check = subprocess.run([haproxy, "-c", "-f", str(cfg)], capture_output=True, text=True, timeout=30)
        assert check.returncode == 0, check.stdout + check.stderr
        procs.append(subprocess.Popen([haproxy, "-f", str(cfg)], cwd=tmp_path, stdout=subprocess.DEVNULL,
                                      stderr=open(tmp_path / "haproxy.log", "w")))  # noqa: SIM115

        deadline = time.monotonic() + 60
        weights_seen: dict[str, set[str]] = {}
        while True:
            rows = []
            if sock.exists():
                csv = haproxy_cmd(sock, "show stat")
                header = csv.splitlines()[0].lstrip("# ").split(",")
                rows = [dict(zip(header, r.split(","))) for r in csv.splitlines()[1:] if r.startswith("llm_llama_8b,vllm-")]
            for r in rows:
                weights_seen.setdefault(r["svname"], set()).add(r["weight"])
            # A new backend starts "warming" in the agent and ramps up: the weight HAProxy applies follows
            # the agent's "ready up N%" until the engines are trusted at 100 %.
            if len(rows) == 3 and all(r["agent_status"] == "L7OK" and r["check_status"] == "L7OK"
                                      and r["weight"] == "100" for r in rows):
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"agent checks did not pass: {json.dumps(rows, indent=1)[:3000]}")
            time.sleep(0.5)
        for row in rows:
            assert row["status"] == "UP", row
        # Each server's weight came from its node's agent: HAProxy alone would have kept the configured 100.
        assert any(seen - {"100"} for seen in weights_seen.values()), weights_seen

        for node_ip, (http_port, _) in agents.items():
            with urllib.request.urlopen(f"http://{node_ip}:{http_port}/metrics", timeout=5) as resp:  # noqa: S310
                families = {f.name: f for f in text_string_to_metric_families(resp.read().decode())}
            results = {s.labels["result"]: s.value for s in families["llmdiag_agent_check_requests"].samples
                       if s.name.endswith("_total")}
            assert results["ok"] >= len(nodes[node_ip]), (node_ip, results)
            # Every HAProxy check named a backend this agent knows. (Other programs probing local ports,
            # such as engine discovery sending "GET /metrics", may show up as unknown: not ours.)
            log = (tmp_path / f"agent-{node_ip}.log").read_text()
            unknown = [line for line in log.splitlines() if "unknown server" in line]
            assert not [line for line in unknown if any(address in line for address in engines)], unknown
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()

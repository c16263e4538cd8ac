"""Processes for the gateway benchmarks: fake engines, ``llmdiag gateway``, HAProxy, an instant SSE upstream.

Every piece runs as its own process on 127.0.0.1 (as in production, the
gateway does not share an event loop with the engines or the client), on free
ports, and is stopped when the :class:`Fleet` closes.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
MODEL = "fake/llama3-8b"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                if resp.status < 500:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not come up in {timeout:g} s")
        time.sleep(0.1)


def engine_clock_start(url: str) -> float:
    """Unix time at which a fake engine's clock (the origin of its fault schedule) started.

    Read from its ``process_start_time_seconds``: a benchmark lines its load up with it
    so that a scheduled fault falls at a known instant of the load.
    """
    with urllib.request.urlopen(url + "/metrics", timeout=5.0) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("process_start_time_seconds "):
                return float(line.split(" ", 1)[1])
    raise RuntimeError(f"{url}/metrics has no process_start_time_seconds")


def haproxy_config(port: int, backends: list[str], balance: str = "roundrobin", agent_port: int | None = None) -> str:
    """HAProxy's configuration: one frontend on ``port``, the engines as servers (``balance``), and with
    ``agent_port`` an agent-check per server against ``llmdiag agent``."""
    servers = []
    for i, b in enumerate(backends):
        addr = b.removeprefix("http://")
        line = f"    server s{i} {addr} weight 100"
        if agent_port is not None:
            # The agent knows engines by ip:port (their --backend URLs): send that, newline-ended. In double
            # quotes: HAProxy reads single-quoted strings verbatim, so '...\n' sent a backslash and an "n",
            # the agent waited for a line that never came and answered "ready up 100%" (weights never moved).
            line += f' agent-check agent-addr 127.0.0.1 agent-port {agent_port} agent-inter 1s agent-send "{addr}\\n"'
        servers.append(line)
    return ("global\n    maxconn 4096\n    nbthread 1\n"
            "defaults\n    mode http\n    timeout connect 2s\n    timeout client 120s\n    timeout server 120s\n"
            "    option http-keep-alive\n    option http-no-delay\n    http-reuse safe\n"
            f"frontend fe\n    bind 127.0.0.1:{port}\n    default_backend llm\n"
            f"backend llm\n    balance {balance}\n"
            # Name the server that answered, as the gateway does: the load generator records it.
            "    http-response set-header x-llmdiag-backend %si:%sp\n" + "\n".join(servers) + "\n")


class Fleet:
    """Starts processes and stops them all (SIGTERM, then SIGKILL) on close."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.tmp = Path(tempfile.mkdtemp(prefix="llmdiag-bench-"))
        self.env = {**os.environ, "PYTHONPATH": str(REPO)}

    def spawn(self, args: list[str], name: str, repo: Path = REPO) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        env = self.env if repo == REPO else {**self.env, "PYTHONPATH": str(repo)}
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=repo)
        self.procs.append(proc)
        return proc

    def engine(self, port: int, profile: str = "llama3-8b-h100", faults: str = "", kv_capacity: int | None = None,
               label: str = "e") -> str:
        args = [PY, "-m", "llmdiag.cli", "fake-engine", "--port", str(port), "--model", MODEL, "--profile", profile]
        if faults:
            args += ["--faults", faults]
        if kv_capacity:
            args += ["--kv-capacity", str(kv_capacity)]
        self.spawn(args, f"engine-{label}-{port}")
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health")
        return url

    def gateway(self, port: int, backends: list[str], agents: list[str] = (), extra_toml: str = "",
                loop: str | None = None, repo: Path = REPO) -> str:
        """``llmdiag gateway`` on ``port``; ``loop``: its ``--loop``; ``repo``: run another checkout's code (a before/after)."""
        cfg = self.tmp / f"gateway-{port}.toml"
        cfg.write_text(f'[gateway]\naccess_log = ""\n{extra_toml}\n')
        args = [PY, "-m", "llmdiag.cli", "--config", str(cfg)]
        for b in backends:
            args += ["--backend", b]
        args += ["gateway", "--listen", f"127.0.0.1:{port}"] + (["--loop", loop] if loop else [])
        for a in agents:
            args += ["--agent", a]
        self.spawn(args, f"gateway-{port}", repo)
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/healthz")
        return url

    def haproxy(self, port: int, backends: list[str], balance: str = "roundrobin", agent_port: int | None = None) -> str:
        exe = shutil.which("haproxy")
        if exe is None:
            raise RuntimeError("haproxy is not installed")
        cfg = self.tmp / f"haproxy-{port}.cfg"
        cfg.write_text(haproxy_config(port, backends, balance, agent_port))
        self.spawn([exe, "-f", str(cfg), "-db"], f"haproxy-{port}")
        url = f"http://127.0.0.1:{port}"
        # HAProxy answers / with a 503 from the engines' 404... any HTTP answer means it listens.
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("haproxy did not start") from None
                time.sleep(0.05)
        return url

    def instant_upstream(self, port: int, chunks: int = 8) -> str:
        self.spawn([PY, str(Path(__file__).resolve().parent / "bench_gateway_common.py"), "instant", str(port), str(chunks)],
                   f"instant-{port}")
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health")
        return url

    def llmdiag_agent(self, port: int, check_port: int, engines: list[str]) -> str:
        """``llmdiag agent`` on the engines (engine collector only: fake engines have no GPU, and no BPF compile)."""
        cfg = self.tmp / f"agent-{port}.toml"
        cfg.write_text('[agent]\ncollectors = ["engine"]\ndiscover = false\n')
        args = [PY, "-m", "llmdiag.cli", "--config", str(cfg)]
        for e in engines:
            args += ["--backend", e]
        args += ["agent", "--listen", f"127.0.0.1:{port}", "--agent-check", f"127.0.0.1:{check_port}"]
        self.spawn(args, f"llmdiag-agent-{port}")
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/healthz", timeout=60)
        return url

    def engine_agent(self, port: int, engines: list[str]) -> str:
        self.spawn([PY, str(Path(__file__).resolve().parent / "bench_gateway_common.py"), "agent", str(port), *engines],
                   f"agent-{port}")
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/healthz")
        return url

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _serve_instant(port: int, chunks: int) -> None:
    """An OpenAI-like upstream that streams ``chunks`` tokens at once: what limits req/s is then the proxy."""
    import json

    from aiohttp import web

    async def completions(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        piece = json.dumps({"id": "cmpl-1", "object": "text_completion", "model": MODEL,
                            "choices": [{"index": 0, "text": " tok", "finish_reason": None}]})
        await resp.write(f"data: {piece}\n\n".encode() * chunks + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


def _serve_engine_agent(port: int, engines: list[str]) -> None:
    """A stand-in node agent: the real engine collector and analyzers, serving ``/v1/penalties``.

    ``llmdiag agent`` (another work item) is not on main yet; this runs its
    engine-signal half with the real pieces (``snapshot_ticks`` with the
    ``engine`` collector, :class:`~llmdiag.analyzers.analyzer.Analyzer`,
    :func:`~llmdiag.analyzers.penalties.penalties_document`) once a second.
    No BPF, GPU or /proc collectors: the fake engines have none of those.
    """
    import threading

    from aiohttp import web

    from llmdiag.analyzers.analyzer import Analyzer
    from llmdiag.analyzers.penalties import addresses_of, penalties_document
    from llmdiag.agent.wiring import snapshot_ticks
    from llmdiag.config import Config

    config = Config().with_backends(engines)
    backends = config.backend_list()
    analyzer = Analyzer(config, backends)
    latest = {"doc": penalties_document(time.time(), "bench-node", {}, ttl_seconds=5).dumps()}

    def tick() -> None:
        for snap in snapshot_ticks(config, backends, ["engine"]):
            result = analyzer.observe(snap)
            latest["doc"] = penalties_document(snap.ts, "bench-node", result.backends, addresses_of(backends),
                                               ttl_seconds=5).dumps()

    threading.Thread(target=tick, daemon=True).start()

    async def penalties(request: web.Request) -> web.Response:
        return web.Response(text=latest["doc"], content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/v1/penalties", penalties)
    app.router.add_get("/healthz", health)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


if __name__ == "__main__" and len(sys.argv) >= 2 and sys.argv[1] == "instant":
    _serve_instant(int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 8)
elif __name__ == "__main__" and len(sys.argv) >= 3 and sys.argv[1] == "agent":
    _serve_engine_agent(int(sys.argv[2]), sys.argv[3:])

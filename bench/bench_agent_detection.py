"""Detection latency of ``llmdiag agent``: fault injected -> ``/v1/penalties`` -> HAProxy weight.

    PYTHONPATH=. .venv/bin/python bench/bench_agent_detection.py --runs 5      # ~8 min, as root

Set-up, all real and on 127.0.0.1: three fake engines (``llama-70b-a100-tp8`` preset), one
``llmdiag agent`` with its defaults (1 s ticks, every collector that can run here) and
``--agent-check``, HAProxy 2.6 with ``agent-check agent-inter 500ms`` on the three servers,
and a light load (2 requests/s) through HAProxy.

Each run injects one fault into ``vllm-2`` at an instant the harness knows exactly (T0), so
"the signal appears" at T0:

* ``crash``: SIGKILL of the engine process (the port refuses from then on);
* ``hang``: SIGSTOP (the port still accepts, ``/metrics`` never answers: an engine hanging);
* ``stall``: the engine stops making progress while its ``/metrics`` still answers (a hung
  collective; ``--faults stall:start=S``). The engine is restarted with that schedule before the
  run, and T0 is S after its first answered ``/metrics`` poll; its clock started at most one poll
  (0.1 s) before that, so T0 is at most ~0.1 s late and the latency at most that much short.

T1 is the first ``/v1/penalties`` (polled every 50 ms) in which vllm-2 carries a penalty or
is ejected; T2 the first HAProxy ``show servers state`` (polled every 50 ms) in which it is
down, drained, or its weight fell by at least 10 points (smaller moves are the adaptive
weights settling, not a reaction). Between runs the engine is restarted on the same port and the
harness waits until HAProxy has it back up. Results: ``bench/results/agent_detection.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "integration"))

from agent_support import AgentProcess, free_port, http, llmdiag, stop, wait_for  # noqa: E402

RESULTS = REPO / "bench" / "results" / "agent_detection.json"
ENGINE = ["--profile", "llama-70b-a100-tp8", "--kv-capacity", "60000", "--model", "fake/llama-70b"]
POLL = 0.05
KINDS = ("crash", "hang", "stall")


#: Seconds after its start at which a ``stall`` run's engine stops making progress: time enough
#: for it to be back at full weight in HAProxy first.
STALL_AT = 25.0


def start_engine(port: int, faults: str | None = None) -> subprocess.Popen[str]:
    extra = ["--faults", faults] if faults else []
    proc = llmdiag("fake-engine", "--port", str(port), *ENGINE, *extra, stdout=subprocess.DEVNULL)
    wait_for("the engine", lambda: http(f"http://127.0.0.1:{port}/metrics", timeout=1)[0] == 200, 30, 0.1)
    return proc


def servers_state(sock: Path) -> dict[str, tuple[int, int, int]]:
    """name -> (op_state, admin_state, weight) from HAProxy's stats socket."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(2)
        s.connect(str(sock))
        s.sendall(b"show servers state llm\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    lines = data.decode().splitlines()
    header = next(line for line in lines if line.startswith("# be_id")).lstrip("# ").split()
    col = {name: i for i, name in enumerate(header)}
    out = {}
    for line in lines:
        parts = line.split()
        if len(parts) >= len(header) - 2 and not line.startswith("#"):
            out[parts[col["srv_name"]]] = (int(parts[col["srv_op_state"]]), int(parts[col["srv_admin_state"]]),
                                          int(parts[col["srv_uweight"]]))
    return out


def reacted(before: tuple[int, int, int], now: tuple[int, int, int]) -> bool:
    """HAProxy took the server down, drained it, or cut its weight by 10 points or more."""
    op, admin, weight = now
    return op == 0 or bool(admin & 0x08) or weight <= before[2] - 10


def penalised(agent: AgentProcess) -> bool:
    status, body = http(f"{agent.url}/v1/penalties", timeout=2)
    if status != 200:
        return False
    entry = next(b for b in json.loads(body)["backends"] if b["name"] == "vllm-2")
    return entry["penalty"] > 0 or entry["state"] == "ejected"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per fault kind (default 5)")
    args = parser.parse_args()
    # SIGTERM (timeout, Ctrl-C elsewhere) unwinds through the finally blocks: no orphaned servers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    tmp = Path(tempfile.mkdtemp(prefix="llmdiag-bench-detect-"))
    ports = [free_port() for _ in range(3)]
    engines = [start_engine(p) for p in ports]
    config = "\n".join(f'[[backends]]\nname = "vllm-{i}"\nurl = "http://127.0.0.1:{p}"\nengine = "vllm"\n'
                       for i, p in enumerate(ports))
    agent = AgentProcess([], tmp, config=config)
    fe_port = free_port()
    sock = tmp / "haproxy.sock"
    servers = "\n".join(f"    server vllm-{i} 127.0.0.1:{p} weight 100 agent-check agent-addr 127.0.0.1 "
                        f"agent-port {agent.check_port} agent-inter 500ms agent-send \"llm/vllm-{i}\\n\""
                        for i, p in enumerate(ports))
    (tmp / "haproxy.cfg").write_text(f"""global
    stats socket {sock} mode 600 level admin
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
    haproxy = subprocess.Popen(["haproxy", "-f", str(tmp / "haproxy.cfg"), "-db"], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    stop_load = threading.Event()

    def load() -> None:
        from llmdiag.sim.demo_fleet import run_load

        async def go() -> None:
            done = asyncio.Event()
            asyncio.get_running_loop().run_in_executor(None, lambda: (stop_load.wait(), done.set()))
            await run_load([f"http://127.0.0.1:{fe_port}"], "fake/llama-70b", 2.0, 3600, client_timeout_s=20, stop=done)

        asyncio.run(go())

    runs: list[dict[str, object]] = []
    try:
        agent.wait_ready(ticks=3, timeout=180)
        wait_for("HAProxy", sock.exists, 10)
        threading.Thread(target=load, daemon=True).start()
        for n in range(args.runs * len(KINDS)):
            kind = KINDS[n % len(KINDS)]
            stall_at = None
            if kind == "stall":
                stop(engines[2])
                engines[2] = start_engine(ports[2], f"stall:start={STALL_AT:g},duration=60")
                stall_at = time.monotonic() + STALL_AT
            # Healthy and at full weight before each injection.
            wait_for("vllm-2 back to full health", lambda: not penalised(agent) and servers_state(sock)["vllm-2"][0] == 2
                     and servers_state(sock)["vllm-2"][2] >= 90, 180, 0.25)
            before = servers_state(sock)["vllm-2"]
            proc = engines[2]
            if stall_at is None:
                t0 = time.monotonic()
                proc.send_signal(signal.SIGKILL if kind == "crash" else signal.SIGSTOP)
            else:
                if time.monotonic() > stall_at - 1:
                    raise RuntimeError("the stall began before vllm-2 was back at full weight: raise STALL_AT")
                time.sleep(stall_at - time.monotonic())
                t0 = time.monotonic()
            t1 = t2 = None
            while time.monotonic() - t0 < 60 and (t1 is None or t2 is None):
                if t1 is None and penalised(agent):
                    t1 = time.monotonic() - t0
                if t2 is None and reacted(before, servers_state(sock)["vllm-2"]):
                    t2 = time.monotonic() - t0
                time.sleep(POLL)
            after = servers_state(sock)["vllm-2"]
            runs.append({"fault": kind, "penalty_seconds": t1, "haproxy_seconds": t2, "haproxy_after": after})
            print(f"run {n + 1}: {kind:5s} penalty after {t1 if t1 is None else round(t1, 2)} s, HAProxy after "
                  f"{t2 if t2 is None else round(t2, 2)} s (op/admin/weight {before} -> {after})", flush=True)
            if kind == "hang":
                proc.send_signal(signal.SIGCONT)
            stop(proc)
            engines[2] = start_engine(ports[2])
    finally:
        stop_load.set()
        code, log, took = agent.stop()
        stop(haproxy)  # type: ignore[arg-type]
        for proc in engines:
            stop(proc)
    summary = {}
    for kind in KINDS:
        mine = [r for r in runs if r["fault"] == kind]
        for key in ("penalty_seconds", "haproxy_seconds"):
            values = sorted(float(r[key]) for r in mine if r[key] is not None)  # type: ignore[arg-type]
            summary[f"{kind}_{key}"] = {"n": len(values), "missed": len(mine) - len(values),
                                        "median": round(statistics.median(values), 2) if values else None,
                                        "max": round(max(values), 2) if values else None}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"runs": runs, "summary": summary, "agent_exit": code,
                                   "agent_stop_seconds": round(took, 2)}, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

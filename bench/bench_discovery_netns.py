#!/usr/bin/env python3
"""Engine discovery with N pods in network namespaces of their own (needs root and iproute2).

    sudo .venv/bin/python bench/bench_discovery_netns.py [--pods 32] [--runs 20] [--json OUT]

Sets up N pod-like namespaces (veth pair, pod end ``eth0`` with a /30 in 10.204.0.0/16, default
route via the node's end) and in each a small engine: Python's ``http.server`` serving a recorded
vLLM scrape as ``/metrics`` on 0.0.0.0:8000. Then times, on the real /proc:

* the namespace pass alone (``discover(ports=[1])``: every pid's ``ns/net`` link, the fd pass over
  the pods' processes, each namespace's tcp/tcp6 tables; no probe), cold (every table read: the
  first discovery, and what every pass would cost without the cache) and warm (the agent's
  steady state, every ``discover_interval_seconds``: tables re-read only where sockets changed);
* a whole ``discover()`` (the probes of the node's own ports included: on a shared machine these
  are other people's servers, so the number printed with it says how many there were).

Everything it creates is removed on exit, also on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from llmdiag.collectors import discovery  # noqa: E402
from llmdiag.collectors.discovery import discover  # noqa: E402
from llmdiag.collectors.netns import scan_namespaces  # noqa: E402

SCRAPE = REPO.parent / "shared" / "fixtures" / "engines" / "vllm_v1_real_scrape_0.9era.prom"
PORT = 8000


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pods", type=int, default=32)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if os.geteuid() != 0 or shutil.which("ip") is None:
        print("needs root and iproute2", file=sys.stderr)
        return 2
    used = ip("-4", "route", "show", "table", "all").stdout + ip("-4", "-o", "addr").stdout
    if "10.204." in used:
        print("10.204.0.0/16 is in use on this host; this benchmark needs it free", file=sys.stderr)
        return 2
    tag = os.getpid() % 1000
    site = Path(tempfile.mkdtemp(prefix="llmdiag-bench-netns-", dir="/tmp"))
    site.chmod(0o755)
    (site / "metrics").write_text(SCRAPE.read_text())
    made: list[tuple[str, str]] = []
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i in range(args.pods):
            netns, host_end = f"llmdiag-bench-{tag}-{i}", f"lb{i}h{tag}"
            ip("netns", "add", netns)
            made.append((netns, host_end))
            subnet = ipaddress.ip_network(f"10.204.{i}.0/30")
            gateway, address = (str(h) for h in subnet.hosts())
            ip("link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", netns)
            ip("-n", netns, "addr", "add", f"{address}/30", "dev", "eth0")
            ip("-n", netns, "link", "set", "eth0", "up")
            ip("-n", netns, "link", "set", "lo", "up")
            ip("addr", "add", f"{gateway}/30", "dev", host_end)
            ip("link", "set", host_end, "up")
            ip("-n", netns, "route", "add", "default", "via", gateway)
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", netns, "/usr/bin/python3", "-m", "http.server", str(PORT), "--bind", "0.0.0.0"],
                cwd=site, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ready = sum(1 for p in procs if f":{PORT:04X} 00000000:0000 0A" in _tcp(p.pid))
            if ready == len(procs):
                break
            time.sleep(0.2)
        else:
            print(f"only {ready} of {len(procs)} pod engines listen after 60 s", file=sys.stderr)
            return 1

        scan = scan_namespaces()
        pids = sum(len(p) for p in scan.groups.values())
        cold, warm, whole = [], [], []
        for _ in range(args.runs):
            discovery._TABLES = discovery._TableCache()
            t0 = time.perf_counter()
            discover(ports=[1])
            cold.append((time.perf_counter() - t0) * 1000)
            reads_cold = discovery._TABLES.reads
            t0 = time.perf_counter()
            discover(ports=[1])
            warm.append((time.perf_counter() - t0) * 1000)
            reads_warm = discovery._TABLES.reads - reads_cold
        found = []
        for _ in range(max(3, args.runs // 4)):
            t0 = time.perf_counter()
            result = discover()
            whole.append((time.perf_counter() - t0) * 1000)
            found = result.backends
        pod_engines = sum(1 for b in found if b.host.startswith("10.204."))
        node_engines = len(found) - pod_engines
        out = {
            "pods": args.pods, "pids": pids, "namespaces": len(scan.groups),
            "namespace_pass_cold_ms": {"p50": round(statistics.median(cold), 1), "p99": round(pct(cold, 0.99), 1)},
            "namespace_pass_warm_ms": {"p50": round(statistics.median(warm), 1), "p99": round(pct(warm, 0.99), 1)},
            "tables_read_cold": reads_cold, "tables_read_warm": reads_warm,
            "discover_ms": {"p50": round(statistics.median(whole), 1), "max": round(max(whole), 1)},
            "pod_engines_found": pod_engines, "node_engines_found": node_engines,
            "loadavg": os.getloadavg(),
        }
        print(json.dumps(out, indent=2))
        if args.json:
            args.json.write_text(json.dumps(out, indent=2) + "\n")
        return 0 if pod_engines == args.pods else 1
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        for netns, host_end in made:
            ip("link", "del", host_end, check=False)
            ip("netns", "del", netns, check=False)
        shutil.rmtree(site, ignore_errors=True)


def _tcp(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/net/tcp").read_text()
    except OSError:
        return ""


if __name__ == "__main__":
    sys.exit(main())

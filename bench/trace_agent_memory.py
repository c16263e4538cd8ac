"""What the running agent's Python heap keeps growing, minute by minute (tracemalloc).

    .venv/bin/python bench/trace_agent_memory.py --minutes 1,5,10,12      # as root, ~13 min

The soak's set-up in one process: the fleet of ``bench/soak_agent.py fleet`` (16 fake engines,
changing load, scripted faults) in a child process, and ``llmdiag agent`` (every collector this
machine can run) in this process with ``tracemalloc`` on, its HTTP server polled for
``/v1/penalties`` 4 times a second and ``/metrics`` every 10 s, as the soak does. At each mark the
process RSS and the traced heap are printed, and between marks the 15 source lines whose
allocations grew most. What the trace does not see (C allocations: bcc, glibc arenas, ctypes
buffers) is the RSS growth the traced heap does not explain. tracemalloc slows the agent: its CPU
and tick figures mean nothing here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
import urllib.request
from pathlib import Path

from bench_agent_loop import rss_mb  # this directory is on sys.path when run as a script

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", default="1,5,10,12", help="marks, minutes after the agent's first tick")
    ap.add_argument("--engines", type=int, default=16)
    args = ap.parse_args()
    marks = [float(m) * 60 for m in args.minutes.split(",")]
    work = Path(tempfile.mkdtemp(prefix="llmdiag-trace-"))
    ready = work / "fleet.json"
    fleet = subprocess.Popen([sys.executable, str(REPO / "bench" / "soak_agent.py"), "fleet", "--engines", str(args.engines),
                              "--ready", str(ready), "--duration", str(marks[-1] + 300)],
                             cwd=work, stdout=subprocess.DEVNULL, stderr=open(work / "fleet.log", "w"))  # noqa: SIM115
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() or not ready.read_text():
            if fleet.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the fleet did not start: {(work / 'fleet.log').read_text()[-2000:]}")
            time.sleep(0.2)
        urls = json.loads(ready.read_text())["urls"]
        from llmdiag.agent.daemon import Agent  # noqa: PLC0415
        from llmdiag.config import Config  # noqa: PLC0415

        toml = '[agent]\nlisten_port = 0\n' + "".join(f'[[backends]]\nurl = "{u}"\n' for u in urls)
        agent = Agent(Config.from_toml(toml))
        tracemalloc.start(1)
        thread = threading.Thread(target=lambda: asyncio.run(agent.run()), daemon=True)
        thread.start()
        while agent.state.ticks < 1:
            if agent.fatal:
                raise SystemExit(agent.fatal)
            time.sleep(0.2)
        assert agent.http_address is not None
        base = f"http://127.0.0.1:{agent.http_address[1]}"
        t0 = time.monotonic()
        print(f"agent ticking, {len(urls)} backends; RSS {rss_mb():.1f} MB", file=sys.stderr, flush=True)
        previous = None
        last_metrics = 0.0
        for mark in marks:
            while time.monotonic() - t0 < mark:
                urllib.request.urlopen(base + "/v1/penalties", timeout=2).read()
                if time.monotonic() - last_metrics >= 10:
                    urllib.request.urlopen(base + "/metrics", timeout=5).read()
                    last_metrics = time.monotonic()
                time.sleep(0.25)
            snap = tracemalloc.take_snapshot()
            traced, _ = tracemalloc.get_traced_memory()
            print(f"\n== {mark / 60:g} min: RSS {rss_mb():.1f} MB, traced heap {traced / 2**20:.1f} MiB, "
                  f"{agent.state.ticks} ticks", flush=True)
            if previous is not None:
                for stat in snap.compare_to(previous, "lineno")[:15]:
                    print(f"  {stat}", flush=True)
            previous = snap
        agent.stop()
        thread.join(10)
    finally:
        fleet.terminate()
        fleet.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())

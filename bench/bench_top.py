"""CPU of ``llmdiag top`` rendering N backends at 1 Hz, measured in a real terminal (tmux).

    .venv/bin/python bench/bench_top.py --backends 64 --seconds 60

A recording of N backends (the analyzers' synthetic healthy fleet, a few of
them going wrong after 40 s) is replayed by ``llmdiag top --replay FILE`` at
real speed (1 tick per second) in a tmux pane; after a warm-up, the process's
user+system CPU time is read from ``/proc/PID/stat`` at the start and at the
end of the window. The number includes everything ``top`` does per tick: the
AgentLoop (analyzers and balancer) over the N backends, the model update and
the redraw of the fleet view. Prints one JSON line, with the same window per
thread: ``ui_thread_percent`` is the main thread (Textual's event loop: the
model update and the redraw), ``other_threads_percent`` the rest, busiest first
(the source worker, which runs the AgentLoop, is normally the first; then
Textual's output writer and input threads).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from llmdiag.analyzers.timelines import TimelineBuilder, dist
from llmdiag.model import write_snapshots

REPO = Path(__file__).resolve().parents[1]


def _recording(path: Path, backends: int, seconds: int) -> Path:
    names = [f"vllm-{i}" for i in range(backends)]
    t = TimelineBuilder(names).advance(40)
    t.backend(names[1]).set(kv_cache_usage=0.97, requests_waiting=6.0).rate("preemptions_total", 0.5)
    t.backend(names[2]).set(ttft_seconds=dist(6.0)).rate("tcp_peer_closes_total", 6.0)
    t.advance(seconds)
    write_snapshots(path, t.snapshots)
    return path


def _cpu_seconds(stat: Path) -> float:
    """user+system CPU seconds from a ``/proc/PID/stat`` or ``/proc/PID/task/TID/stat`` file."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds per thread id; a thread that ended between listing and reading is left out."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = _cpu_seconds(task / "stat")
        except (OSError, ValueError):
            continue
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", type=int, default=64)
    parser.add_argument("--seconds", type=int, default=60, help="measured window (after --warmup)")
    parser.add_argument("--warmup", type=int, default=15)
    parser.add_argument("--width", type=int, default=160)
    parser.add_argument("--height", type=int, default=50)
    parser.add_argument("--keys", nargs="*", default=[], metavar="KEY",
                        help="tmux keys sent 3 s after start, before the warm-up ends (e.g. Enter: the backend "
                             "view of the row under the cursor; h: the host view)")
    args = parser.parse_args()
    if shutil.which("tmux") is None:
        print("bench_top: tmux is needed (scripts/setup.sh installs it)", file=sys.stderr)
        return 64
    with tempfile.TemporaryDirectory() as tmp:
        recording = _recording(Path(tmp) / "fleet.jsonl", args.backends, args.warmup + args.seconds + 30)
        session = f"bench-top-{uuid.uuid4().hex[:8]}"
        command = f"cd {REPO} && exec env PYTHONPATH={REPO} {sys.executable} -m llmdiag.cli top --replay {recording}"
        subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", str(args.width), "-y", str(args.height),
                        command], check=True)
        try:
            pid = int(subprocess.run(["tmux", "display", "-p", "-t", session, "#{pane_pid}"], capture_output=True,
                                     text=True, check=True).stdout.strip())
            if args.keys:
                time.sleep(3)  # the app is up and the fleet table is filled
                subprocess.run(["tmux", "send-keys", "-t", session, *args.keys], check=True)
            time.sleep(max(0, args.warmup - (3 if args.keys else 0)))
            stat = Path(f"/proc/{pid}/stat")
            cpu0, threads0, wall0 = _cpu_seconds(stat), _thread_cpu(pid), time.monotonic()
            time.sleep(args.seconds)
            cpu1, threads1, wall1 = _cpu_seconds(stat), _thread_cpu(pid), time.monotonic()
            screen = subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout
        finally:
            subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
    status = screen.splitlines()[0] if screen else ""
    window = wall1 - wall0
    # Threads that existed for the whole window; one started inside it counts from zero.
    per_thread = {tid: threads1[tid] - threads0.get(tid, 0.0) for tid in threads1}
    others = sorted((round(100 * cpu / window, 2) for tid, cpu in per_thread.items() if tid != pid), reverse=True)
    result = {"backends": args.backends, "window_seconds": round(window, 2),
              "cpu_seconds": round(cpu1 - cpu0, 3), "cpu_percent_of_one_core": round(100 * (cpu1 - cpu0) / window, 2),
              "ui_thread_percent": round(100 * per_thread.get(pid, 0.0) / window, 2), "other_threads_percent": others,
              "terminal": f"{args.width}x{args.height}", "keys": args.keys, "status_line": status.strip(), "load_average": os.getloadavg()[0]}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Overhead of the tcp collector and cost of a TIME_WAIT read (SPEC section 10).

    sudo .venv/bin/python bench/bench_tcp.py [--seconds 5] [--timewait 30000] [--json bench/results/tcp.json]

Measures, in one run on loopback:

1. in-kernel cost per event of every tcp_health program, from bpf_stats
   (``kernel.bpf_stats_enabled=1``; ``run_time_ns / run_cnt`` read from the
   program fds' fdinfo, the same counters ``bpftool prog show`` prints);
2. loopback send throughput with the collector's programs detached and
   attached (the port is a port of interest, so every send is attributed),
   in paired rounds that alternate the order, for 16 KiB and 512 B sends
   (sender and receiver are child processes; the machine is shared, so the
   median of per-round ratios is reported with its range);
3. the agent's CPU (user + system of this process, which only runs the
   collector's ticks at 1 Hz) while a child sends 20k paced sends per second;
4. the time of one TIME_WAIT collection (sockstat + sock_diag dump + parse)
   with ``--timewait`` TIME_WAIT sockets present.

bpf_stats_enabled is restored to its previous value at the end.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import resource
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmdiag.collectors.tcp import TcpCollector  # noqa: E402
from llmdiag.collectors.timewait import TimewaitCollector  # noqa: E402
from llmdiag.config.tcp import TcpConfig, TimewaitConfig  # noqa: E402
from llmdiag.model import Backend  # noqa: E402

STATS = Path("/proc/sys/kernel/bpf_stats_enabled")


def say(text: str) -> None:
    print(f"[bench tcp] {text}", flush=True)


# -- traffic (child processes) --------------------------------------------------------


def _receiver(port_q: mp.Queue, stop: mp.Event) -> None:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    port_q.put(srv.getsockname()[1])
    buf = bytearray(1 << 20)
    while True:  # one sender at a time
        conn, _ = srv.accept()
        while conn.recv_into(buf):
            pass
        conn.close()


def _sender(port: int, size: int, seconds: float, rate: float, out: mp.Queue) -> None:
    sock = socket.create_connection(("127.0.0.1", port))
    payload = b"x" * size
    sent = calls = 0
    start = time.perf_counter()
    end = start + seconds
    interval = 1.0 / rate if rate else 0.0
    next_at = start
    while True:
        now = time.perf_counter()
        if now >= end:
            break
        if interval:
            if now < next_at:
                time.sleep(max(0.0, min(next_at - now, 0.001)))
                continue
            next_at += interval
        sent += sock.send(payload)
        calls += 1
    out.put((sent, calls, time.perf_counter() - start))
    sock.close()


def run_traffic(port: int, size: int, seconds: float, rate: float = 0.0) -> tuple[float, float]:
    """Bytes/s and sends/s of one sender over ``seconds``."""
    out: mp.Queue = mp.Queue()
    proc = mp.Process(target=_sender, args=(port, size, seconds, rate, out))
    proc.start()
    sent, calls, elapsed = out.get(timeout=seconds + 30)
    proc.join()
    return sent / elapsed, calls / elapsed


def start_receiver() -> tuple[mp.Process, int]:
    port_q: mp.Queue = mp.Queue()
    proc = mp.Process(target=_receiver, args=(port_q, mp.Event()), daemon=True)
    proc.start()
    return proc, port_q.get(timeout=10)


# -- measurements ------------------------------------------------------------------------


def prog_stats(collector: TcpCollector) -> dict[str, tuple[int, int]]:
    """``name -> (run_cnt, run_time_ns)`` from /proc/self/fdinfo of each loaded program."""
    out = {}
    assert collector.program is not None
    for name, fn in collector.program.bpf.funcs.items():
        text = Path(f"/proc/self/fdinfo/{fn.fd}").read_text()
        cnt = re.search(r"run_cnt:\s*(\d+)", text)
        ns = re.search(r"run_time_ns:\s*(\d+)", text)
        if cnt and ns:
            out[name.decode() if isinstance(name, bytes) else name] = (int(cnt.group(1)), int(ns.group(1)))
    return out


class Attachment:
    """Detach and re-attach a loaded collector's programs in milliseconds, so that
    "without" and "with" runs can alternate quickly on a shared, noisy machine."""

    def __init__(self, collector: TcpCollector) -> None:
        assert collector.program is not None
        self.bpf = collector.program.bpf
        self.tracepoints = [tp for tp in self.bpf.tracepoint_fds]
        self.raw = [tp for tp in self.bpf.raw_tracepoint_fds]
        self.attached = True

    def detach(self) -> None:
        if not self.attached:
            return
        self.attached = False
        for tp in self.tracepoints:
            self.bpf.detach_tracepoint(tp)
        for tp in self.raw:
            self.bpf.detach_raw_tracepoint(tp)

    def attach(self) -> None:
        if self.attached:
            return
        self.attached = True
        for tp in self.tracepoints:
            category, event = tp.split(b":")
            self.bpf.attach_tracepoint(tp=tp, fn_name=b"tracepoint__" + category + b"__" + event)
        for tp in self.raw:
            self.bpf.attach_raw_tracepoint(tp=tp, fn_name=b"raw_tracepoint__" + tp)


def throughput(size: int, seconds: float, rounds: int, config: TcpConfig | None = None) -> dict[str, float]:
    """Paired runs: in each round one run detached and one attached (order alternating),
    same receiver, same loaded program; the result is the median of the per-round ratios."""
    rx, port = start_receiver()
    collector = TcpCollector(config or TcpConfig(), [Backend.from_url(f"http://127.0.0.1:{port}", name="bench")])
    assert collector.unavailable is None, collector.unavailable
    switch = Attachment(collector)
    without: list[float] = []
    with_: list[float] = []
    ratios: list[float] = []
    try:
        for i in range(rounds):
            pair = {}
            for attached in ((False, True) if i % 2 == 0 else (True, False)):
                (switch.attach if attached else switch.detach)()
                pair[attached] = run_traffic(port, size, seconds)[0]
            switch.attach()
            without.append(pair[False])
            with_.append(pair[True])
            ratios.append(pair[True] / pair[False])
    finally:
        collector.close()
        rx.kill()
    return {"without_MBps": statistics.median(without) / 1e6, "with_MBps": statistics.median(with_) / 1e6,
            "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "rounds": rounds}


def agent_cpu_at_rate(rate: float, seconds: float) -> dict[str, float]:
    rx, port = start_receiver()
    collector = TcpCollector(TcpConfig(), [Backend.from_url(f"http://127.0.0.1:{port}", name="bench")])
    out: mp.Queue = mp.Queue()
    proc = mp.Process(target=_sender, args=(port, 100, seconds, rate, out))
    before = resource.getrusage(resource.RUSAGE_SELF)
    wall0 = time.monotonic()
    proc.start()
    ticks = []
    while proc.is_alive() and time.monotonic() - wall0 < seconds + 5:
        t0 = time.perf_counter()
        collector.collect(time.time())
        ticks.append(time.perf_counter() - t0)
        time.sleep(max(0.0, 1.0 - (time.perf_counter() - t0)))
    sent, calls, elapsed = out.get(timeout=30)
    proc.join()
    wall = time.monotonic() - wall0
    after = resource.getrusage(resource.RUSAGE_SELF)
    sends = collector.collect(time.time())
    collector.close()
    rx.kill()
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        "sends_per_second": calls / elapsed,
        "agent_cpu_percent_of_core": 100 * cpu / wall,
        "tick_ms_median": 1000 * statistics.median(ticks),
        "samples_per_tick": len(sends),
    }


def make_timewait(count: int) -> list[str]:
    """``count`` TIME_WAIT sockets spread over a few loopback listeners (one port range each)."""
    per_listener = 12_000  # well inside one port range, so tcp_tw_reuse does not recycle them
    listeners = []
    made = 0
    while made < count:
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(4096)
        listeners.append(srv)
        want = min(per_listener, count - made)
        for _ in range(want):
            client = socket.create_connection(srv.getsockname())
            conn, _ = srv.accept()
            client.close()
            conn.recv(1)
            conn.close()
        made += want
    dests = [f"127.0.0.1:{s.getsockname()[1]}" for s in listeners]
    for s in listeners:
        s.close()
    return dests


def timewait_read(count: int, repeats: int = 20) -> dict[str, float]:
    t0 = time.perf_counter()
    dests = make_timewait(count)
    made_in = time.perf_counter() - t0
    collector = TimewaitCollector(TimewaitConfig(), [Backend.from_url(f"http://{d}") for d in dests])
    times = []
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        samples = collector.collect(time.time())
        times.append(time.perf_counter() - t)
    found = sum(s.value for s in samples if s.name == "timewait_sockets" and s.subject in dests)
    return {"timewait_sockets_found": found, "made_seconds": made_in,
            "read_ms_median": 1000 * statistics.median(times), "read_ms_max": 1000 * max(times)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.5, help="seconds per throughput run")
    parser.add_argument("--rounds", type=int, default=10, help="paired without/with runs per throughput case")
    parser.add_argument("--rate", type=float, default=20_000.0, help="paced sends/s for the agent CPU run")
    parser.add_argument("--timewait", type=int, default=30_000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("needs root (BPF)", file=sys.stderr)
        return 2

    previous = STATS.read_text().strip()
    STATS.write_text("1\n")
    results: dict[str, object] = {"kernel": os.uname().release, "cpus": os.cpu_count()}
    try:
        say("in-kernel cost per event (bpf_stats), 512 B and 16 KiB sends")
        rx, port = start_receiver()
        collector = TcpCollector(TcpConfig(send_timing=True),
                                 [Backend.from_url(f"http://127.0.0.1:{port}", name="bench")])
        before = prog_stats(collector)
        run_traffic(port, 512, args.seconds)
        run_traffic(port, 16384, args.seconds)
        after = prog_stats(collector)
        collector.close()
        rx.kill()
        per_prog = {}
        for name, (cnt, ns) in after.items():
            dcnt = cnt - before.get(name, (0, 0))[0]
            dns = ns - before.get(name, (0, 0))[1]
            if dcnt:
                per_prog[name] = {"events": dcnt, "ns_per_event": dns / dcnt}
        results["bpf_cost"] = per_prog
        for name, row in sorted(per_prog.items()):
            say(f"  {name:45s} {row['events']:>10d} events {row['ns_per_event']:8.1f} ns/event")

        for size in (16384, 512):
            say(f"throughput, {size} B sends, {args.rounds} paired detached/attached rounds x {args.seconds}s")
            results[f"throughput_{size}B"] = row = throughput(size, args.seconds, args.rounds)
            say(f"  without {row['without_MBps']:.1f} MB/s, with {row['with_MBps']:.1f} MB/s, "
                f"ratio {row['ratio']:.3f} (rounds {row['ratio_min']:.2f}..{row['ratio_max']:.2f})")

        say("throughput, 512 B sends, with [tcp] send_timing = true (syscall tracepoints attached)")
        results["throughput_512B_send_timing"] = row = throughput(512, args.seconds, args.rounds, TcpConfig(send_timing=True))
        say(f"  without {row['without_MBps']:.1f} MB/s, with {row['with_MBps']:.1f} MB/s, "
            f"ratio {row['ratio']:.3f} (rounds {row['ratio_min']:.2f}..{row['ratio_max']:.2f})")

        say(f"agent CPU at {args.rate:.0f} sends/s")
        results["agent_cpu"] = row = agent_cpu_at_rate(args.rate, max(args.seconds * 2, 10))
        say(f"  {row['sends_per_second']:.0f} sends/s, agent CPU {row['agent_cpu_percent_of_core']:.2f} % of a core, "
            f"tick {row['tick_ms_median']:.2f} ms")
    finally:
        STATS.write_text(previous + "\n")

    say(f"TIME_WAIT read with {args.timewait} sockets")
    results["timewait"] = row = timewait_read(args.timewait)
    say(f"  found {row['timewait_sockets_found']} TIME_WAIT, read {row['read_ms_median']:.1f} ms median "
        f"({row['read_ms_max']:.1f} max)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""Cost of the http2 frame collector: in-kernel time per traced syscall and gRPC throughput.

    .venv/bin/python bench/bench_http2.py [--seconds 4] [--rounds 3] [--size 4096] [--json]

A gRPC server (grpcio, generic handler, a subprocess: the traced backend pid)
streams ``--size``-byte messages as fast as a client in this process reads
them. Each round measures messages/s for ``--seconds`` without the collector,
then with it. Three phases: ``detached`` (no program; measured first and
again last, so load order does not bias it), ``attached_unwatched`` (the
programs are attached but the server pid is not in ``watched_pids``: every
syscall on the host pays the tracepoint and one hash lookup) and
``watched`` (the server's connection is walked); unwatched and watched
alternate ``--rounds`` times.

In-kernel cost: ``kernel.bpf_stats_enabled`` is switched on for the run (and
restored), and ``bpftool -j prog show`` gives ``run_time_ns / run_cnt`` of
each of the collector's programs (found as the program ids that appear when
it loads).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

IDENT = lambda b: b  # noqa: E731


def serve(size: int) -> None:
    import grpc

    payload = b"x" * size

    def flood(request, context):
        while context.is_active():
            yield payload

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.H2", {
        "Flood": grpc.unary_stream_rpc_method_handler(flood, request_deserializer=IDENT, response_serializer=IDENT),
    }),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    server.stop(None)


def throughput(port: int, seconds: float) -> float:
    """Messages per second one streaming call delivers for ``seconds``."""
    import grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_stream("/bench.H2/Flood", request_serializer=IDENT, response_deserializer=IDENT)(b"go")
        next(call)  # connected and flowing
        count = 0
        start = time.perf_counter()
        deadline = start + seconds
        for _ in call:
            count += 1
            if count % 256 == 0 and time.perf_counter() >= deadline:
                break
        elapsed = time.perf_counter() - start
        call.cancel()
    return count / elapsed


def prog_stats() -> dict[int, dict]:
    out = subprocess.run(["bpftool", "-j", "prog", "show"], capture_output=True, text=True, check=True).stdout
    return {p["id"]: p for p in json.loads(out)}


def _prog_names(collector) -> dict[int, str]:
    """prog id -> bcc function name (bpftool shows only 15 characters), from /proc/self/fdinfo."""
    names = {}
    for name, fn in collector.kernel.program.bpf.funcs.items():
        try:
            info = Path(f"/proc/self/fdinfo/{fn.fd}").read_text()
        except OSError:
            continue
        for line in info.splitlines():
            if line.startswith("prog_id:"):
                label = name.decode() if isinstance(name, bytes) else str(name)
                names[int(line.split()[1])] = label.replace("tracepoint__syscalls__", "")
    return names


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.size)
        return 0

    from rich.progress import Progress

    from llmdiag.collectors.h2_kernel import H2Kernel
    from llmdiag.collectors.http2 import Http2Collector
    from llmdiag.config.http2 import Http2Config
    from llmdiag.model import Backend

    stats_path = Path("/proc/sys/kernel/bpf_stats_enabled")
    stats_before = stats_path.read_text().strip()
    stats_path.write_text("1\n")
    server = subprocess.Popen([sys.executable, __file__, "--serve", "--size", str(args.size)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    collector = None
    results: dict[str, list[float]] = {"detached": [], "attached_unwatched": [], "watched": []}
    try:
        port = int(server.stdout.readline())  # type: ignore[union-attr]
        with Progress() as progress:
            task = progress.add_task("http2 bench", total=2 + 2 * args.rounds)
            results["detached"].append(throughput(port, args.seconds))
            progress.advance(task)
            before = set(prog_stats())
            config = Http2Config()
            collector = Http2Collector([Backend.from_url(f"grpc://127.0.0.1:{port}", name="bench")],
                                       H2Kernel.load(config), config)
            ours = set(prog_stats()) - before
            names = _prog_names(collector)
            for _ in range(args.rounds):
                collector.kernel.set_pids({})
                results["attached_unwatched"].append(throughput(port, args.seconds))
                progress.advance(task)
                collector.refresh()
                base = {i: p for i, p in prog_stats().items() if i in ours}
                results["watched"].append(throughput(port, args.seconds))
                progress.advance(task)
            after = {i: p for i, p in prog_stats().items() if i in ours}
            signals = {s.name: s.value for s in collector.collect(time.time())}
            collector.close()  # and the detached baseline once more, so load order does not bias it
            results["detached"].append(throughput(port, args.seconds))
            progress.advance(task)
        per_prog = {}
        for pid_, prog in after.items():
            runs = prog.get("run_cnt", 0) - base.get(pid_, {}).get("run_cnt", 0)
            ns = prog.get("run_time_ns", 0) - base.get(pid_, {}).get("run_time_ns", 0)
            if runs:
                per_prog[names.get(pid_, str(pid_))] = {"runs": runs, "ns_per_run": ns / runs}
    finally:
        if collector is not None:
            collector.close()
        server.stdin.close()  # type: ignore[union-attr]
        server.wait(10)
        stats_path.write_text(stats_before + "\n")

    median = {k: statistics.median(v) for k, v in results.items()}
    report = {
        "messages_per_second": median,
        "watched_vs_detached": median["watched"] / median["detached"],
        "watched_vs_unwatched": median["watched"] / median["attached_unwatched"],
        "rounds": results,
        "bpf_programs_last_round": per_prog,
        "counted": {k: signals.get(k) for k in ("h2_streams_opened_total", "h2_parse_resyncs_total", "grpc_connections")},
        "message_bytes": args.size,
    }
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        mb = args.size / 1e6
        for name, value in median.items():
            print(f"{name:>20}: {value:10.0f} msg/s  {value * mb:8.1f} MB/s")
        print(f"watched / detached: {report['watched_vs_detached']:.3f}")
        for name, prog in sorted(per_prog.items()):
            print(f"  {name:<16} {prog['runs']:>9} runs  {prog['ns_per_run']:8.0f} ns/run")
        print(f"counted: {report['counted']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

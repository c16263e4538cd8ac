"""CPU of one http2 collector refresh: a full one (the connection tables read) against one between full ones.

    .venv/bin/python bench/bench_http2_refresh.py    # as root (loads the http2_frames BPF program), ~15 s

A grpcio server on 127.0.0.1 with ``--connections`` open client connections, one ``grpc://``
backend, and the real collector (``Http2Collector`` over a loaded ``H2Kernel``). Each kind of
refresh runs ``--rounds`` times, twice, alternating; the figure is the process's CPU time
(user + system: reading ``/proc/net/tcp*`` is kernel time) per call. ``Http2Collector.collect``
does a refresh every ``[http2] refresh_seconds`` (1 s), a full one only when a listener changed
or every ``TABLES_SECONDS``.
"""

from __future__ import annotations

import argparse
import json
import socket
import time
from concurrent import futures

import grpc

from llmdiag.collectors.h2_kernel import H2Kernel
from llmdiag.collectors.http2 import TABLES_SECONDS, Http2Collector
from llmdiag.config.http2 import Http2Config
from llmdiag.model import Backend


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(args.connections)]
    config = Http2Config()
    collector = Http2Collector([Backend.from_url(f"grpc://127.0.0.1:{port}", name="grpc-0")], H2Kernel.load(config), config)
    try:
        collector.refresh()
        ms: dict[str, list[float]] = {"full": [], "between": []}
        for full in (True, False, True, False):
            start = time.process_time()
            for _ in range(args.rounds):
                collector.refresh(full=full)
            ms["full" if full else "between"].append((time.process_time() - start) / args.rounds * 1000)
        watched = len(collector.connections())
    finally:
        collector.close()
        for client in clients:
            client.close()
        server.stop(None)
    full, between = min(ms["full"]), min(ms["between"])
    per_second = (full + (TABLES_SECONDS - 1) * between) / TABLES_SECONDS  # one refresh a second
    print(json.dumps({"full_refresh_ms_cpu": round(full, 2), "between_refresh_ms_cpu": round(between, 2),
                      "at_1s_refreshes_percent_of_a_core": round(per_second / 10, 2),
                      "before_percent_of_a_core": round(full / 10, 2),
                      "connections_watched": watched}, indent=2))
    return 0 if watched == args.connections else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""The Envoy endpoint picker, measured with a real Envoy 1.40 on loopback.

    PYTHONPATH=. .venv/bin/python bench/bench_picker.py all            # everything below, ~4 min
    PYTHONPATH=. .venv/bin/python bench/bench_picker.py latency --requests 2000
    PYTHONPATH=. .venv/bin/python bench/bench_picker.py throughput --seconds 10
    PYTHONPATH=. .venv/bin/python bench/bench_picker.py routing --seconds 40 --rate 8

- ``latency``: added latency of one small JSON POST, sequential on one
  keep-alive connection, to the same trivial upstream (an aiohttp server
  answering at once): direct; Envoy round robin; Envoy + an empty ext_proc
  server (grpc.aio, constant replies: the transport floor); Envoy + the picker
  (reading the body); Envoy + the picker with the model in a header (no body
  message). Rounds alternate the paths so that noise from other jobs on the
  machine spreads evenly. Also the same through a 16-chunk SSE answer, where
  the picker sees every chunk.
- ``throughput``: the picker alone, pinned to one core, driven over gRPC by
  a client pinned to the other with the messages Envoy sends for one
  non-streamed request (request headers, buffered body, response headers;
  and the model-header path without the body); requests/s, and requests per
  CPU-second of the picker (its capacity on one fully busy core, whichever
  side was the limit).
- ``routing``: four fake engines, one degraded 5 s in (steps 4x slower, KV
  cache 10 %), ``llmdiag bench load`` replaying a real trace (default
  azure2023_conv) open-loop at ``--rate``; Envoy + picker against Envoy's
  ``round_robin`` and ``least_request`` on fresh engines each: TTFT p50/p99,
  E2E p99 and goodput (requests/s finished with TTFT <= ``--slo``).

Results: ``bench/results/picker.json`` and the tables printed (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The process harness (fake engines, picker, Envoy) is shared with the integration tests.
sys.path.insert(0, str(REPO / "tests" / "integration"))

from envoy_harness import Proc, free_port, start_envoy, start_fake_engine, start_picker, wait_http  # noqa: E402

MODEL = "fake/llama3-8b"
RESULTS = REPO / "bench" / "results" / "picker.json"


# ---------------------------------------------------------------- trivial upstream


def serve_null(port: int) -> None:
    """A trivial upstream: answers a small JSON body at once (or 16 SSE chunks when asked to stream)."""
    from aiohttp import web

    answer = json.dumps({"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": "ok"}]}).encode()

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if b'"stream": true' in body:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for _ in range(16):
                await resp.write(b'data: {"choices": [{"text": " tok"}]}\n\n')
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        return web.Response(body=answer, content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def serve_empty_ext_proc(port: int, upstream: str) -> None:
    """The transport floor: a grpc.aio ext_proc server with no logic that routes everything to ``upstream``.

    Same server set-up and reply shapes as the picker (identity serializer, context.read/write), no
    parsing, no balancer, no metrics: what Envoy + a Python gRPC server cost before the picker does anything.
    """
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    from llmdiag.picker import protocol

    replies = protocol.ReplyCache()
    on_body = replies.pick(upstream, protocol.ON_BODY)
    on_headers = replies.pick(upstream, protocol.ON_HEADERS_SKIP_BODY)

    async def process(requests, context):  # noqa: ANN001
        while True:
            request = await context.read()
            if request is grpc.aio.EOF:
                return
            kind = request.WhichOneof("request")
            if kind == "request_headers":
                model = protocol.header_value(request.request_headers, "x-gateway-model-name")
                await context.write(on_headers if model else protocol.CONTINUE_REQUEST_HEADERS)
            elif kind == "request_body":
                await context.write(on_body)
            elif kind == "response_headers":
                await context.write(protocol.SKIP_RESPONSE_BODY)
            else:
                await context.write(protocol.CONTINUE_RESPONSE_BODY)

    async def main() -> None:
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "envoy.service.ext_proc.v3.ExternalProcessor",
            {"Process": grpc.stream_stream_rpc_method_handler(process, request_deserializer=pb.ProcessingRequest.FromString,
                                                              response_serializer=None)}),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def _percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    def q(p: float) -> float:
        return ordered[min(len(ordered) - 1, int(p * len(ordered)))]
    return {"p50_ms": round(q(0.50) * 1e3, 3), "p99_ms": round(q(0.99) * 1e3, 3), "mean_ms": round(statistics.fmean(ordered) * 1e3, 3),
            "n": len(ordered)}


def _timed_posts(port: int, n: int, stream: bool, model_header: bool = False) -> list[float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    body = json.dumps({"model": MODEL, "prompt": "hello there", "max_tokens": 1, "stream": stream})
    headers = {"content-type": "application/json"}
    if model_header:
        headers["x-gateway-model-name"] = MODEL
    times = []
    for _ in range(n):
        t = time.perf_counter()
        conn.request("POST", "/v1/completions", body, headers)
        resp = conn.getresponse()
        data = resp.read()
        times.append(time.perf_counter() - t)
        if resp.status != 200 or not data:
            raise RuntimeError(f"status {resp.status}: {data[:200]!r}")
    conn.close()
    return times


def bench_latency(tmp: Path, requests: int, rounds: int = 5) -> dict:
    procs: list[Proc] = []
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    try:
        null_port = free_port()
        null = Proc([sys.executable, __file__, "null-upstream", "--port", str(null_port)], tmp / "null.log", env)
        procs.append(null)
        wait_http(f"http://127.0.0.1:{null_port}/health", 20, null)
        empty_port = free_port()
        procs.append(Proc([sys.executable, __file__, "empty-ext-proc", "--port", str(empty_port),
                           "--upstream", f"127.0.0.1:{null_port}"], tmp / "empty.log", env))
        grpc_port, metrics_port = free_port(), free_port()
        procs.append(start_picker(tmp, [f"http://127.0.0.1:{null_port}"], grpc_port, metrics_port))
        envoy_rr, rr_port, _ = start_envoy(tmp, "round_robin", endpoints=(f"127.0.0.1:{null_port}",), name="envoy-rr")
        procs.append(envoy_rr)
        envoy_empty, empty_listen, _ = start_envoy(tmp, "picker", picker_port=empty_port, name="envoy-empty")
        procs.append(envoy_empty)
        envoy_pk, pk_port, _ = start_envoy(tmp, "picker", picker_port=grpc_port, name="envoy-picker")
        procs.append(envoy_pk)
        # (name, port, model header): the picker reads the body unless the model header is sent.
        paths = [("direct", null_port, False), ("envoy_round_robin", rr_port, False),
                 ("envoy_empty_ext_proc", empty_listen, False), ("envoy_picker", pk_port, False),
                 ("envoy_picker_model_header", pk_port, True)]
        out: dict[str, dict] = {}
        for stream in (False, True):
            samples: dict[str, list[float]] = {name: [] for name, _, _ in paths}
            per_round = max(50, requests // rounds)
            for _, port, header in paths:
                _timed_posts(port, 200, stream, header)  # warm-up: connections, caches, the picker's replies
            for _ in range(rounds):
                for name, port, header in paths:
                    samples[name] += _timed_posts(port, per_round, stream, header)
            kind = "sse_16_chunks" if stream else "json"
            out[kind] = {name: _percentiles(v) for name, v in samples.items()}
            rr = out[kind]["envoy_round_robin"]
            out[kind]["added_over_round_robin_ms"] = {
                name: {"p50": round(out[kind][name]["p50_ms"] - rr["p50_ms"], 3),
                       "p99": round(out[kind][name]["p99_ms"] - rr["p99_ms"], 3)}
                for name in ("envoy_empty_ext_proc", "envoy_picker", "envoy_picker_model_header")}
        return out
    finally:
        for proc in reversed(procs):
            proc.stop()


# ---------------------------------------------------------------- picker throughput


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _drive(port: int, seconds: float, concurrency: int, model_header: bool = False) -> int:
    import grpc
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    def headers(pairs: dict[str, str], response: bool) -> pb.ProcessingRequest:
        h = pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
            base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]))
        return pb.ProcessingRequest(response_headers=h) if response else pb.ProcessingRequest(request_headers=h)

    body = json.dumps({"model": MODEL, "prompt": "x" * 2000, "max_tokens": 64}).encode()
    request_headers = {":method": "POST", ":path": "/v1/completions", "content-type": "application/json",
                       "content-length": str(len(body))}
    if model_header:  # the fast path: no body message
        messages = [headers({**request_headers, "x-gateway-model-name": MODEL}, False),
                    headers({":status": "200", "content-type": "application/json"}, True)]
    else:
        messages = [headers(request_headers, False),
                    pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)),
                    headers({":status": "200", "content-type": "application/json"}, True)]
    done = 0
    stop_at = time.monotonic() + seconds
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        process = channel.stream_stream("/envoy.service.ext_proc.v3.ExternalProcessor/Process",
                                        request_serializer=pb.ProcessingRequest.SerializeToString,
                                        response_deserializer=pb.ProcessingResponse.FromString)

        async def worker() -> None:
            nonlocal done
            while time.monotonic() < stop_at:
                call = process()
                for m in messages:
                    await call.write(m)
                    await call.read()
                await call.done_writing()
                done += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done


def bench_throughput(tmp: Path, seconds: float, concurrency: int) -> dict:
    procs: list[Proc] = []
    try:
        engines = [f"http://127.0.0.1:{free_port()}" for _ in range(8)]  # picked, never contacted
        grpc_port, metrics_port = free_port(), free_port()
        picker = start_picker(tmp, engines, grpc_port, metrics_port)
        procs.append(picker)
        pinned = os.cpu_count() and os.cpu_count() > 1
        if pinned:
            os.sched_setaffinity(picker.popen.pid, {1})
            os.sched_setaffinity(0, {0})
        out: dict = {"concurrency": concurrency, "pinned_one_core_each": bool(pinned)}
        for name, header in (("body", False), ("model_header", True)):
            asyncio.run(_drive(grpc_port, 1.0, concurrency, header))  # warm-up
            cpu0, t0 = _cpu_seconds(picker.popen.pid), time.monotonic()
            done = asyncio.run(_drive(grpc_port, seconds, concurrency, header))
            cpu1, t1 = _cpu_seconds(picker.popen.pid), time.monotonic()
            out[name] = {"requests": done, "seconds": round(t1 - t0, 2), "requests_per_second": round(done / (t1 - t0)),
                         "picker_cpu_seconds": round(cpu1 - cpu0, 2),
                         "requests_per_picker_cpu_second": round(done / max(1e-9, cpu1 - cpu0))}
        return out
    finally:
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
        for proc in reversed(procs):
            proc.stop()


# ---------------------------------------------------------------- routing on live engines


def bench_routing(tmp: Path, seconds: float, rate: float, slo: float, trace: str) -> dict:
    out = {}
    faults = "slowdown:start=5,speed=0.2;kv_shrink:start=5,factor=0.05"
    for policy in ("round_robin", "least_request", "picker"):
        procs: list[Proc] = []
        try:
            ports = []
            for i in range(4):
                args = ("--faults", faults) if i == 3 else ()
                proc, port = start_fake_engine(tmp, f"{policy}-{i}", *args)
                procs.append(proc)
                ports.append(port)
            endpoints = tuple(f"127.0.0.1:{p}" for p in ports)
            if policy == "picker":
                grpc_port, metrics_port = free_port(), free_port()
                procs.append(start_picker(tmp, [f"http://{e}" for e in endpoints], grpc_port, metrics_port,
                                          name=f"picker-{policy}"))
                envoy, listen, _ = start_envoy(tmp, "picker", picker_port=grpc_port, name=f"envoy-{policy}")
            else:
                envoy, listen, _ = start_envoy(tmp, policy, endpoints=endpoints, name=f"envoy-{policy}")
            procs.append(envoy)
            # The load generator is `llmdiag bench load` (open loop, the trace's sizes and burstiness).
            load = subprocess.run(
                [sys.executable, "-m", "llmdiag.cli", "bench", "load", "--target", f"http://127.0.0.1:{listen}",
                 "--trace", trace, "--rate", str(rate), "--duration", str(seconds), "--slo-ttft", str(slo),
                 "--max-prompt-tokens", "8000", "--model", MODEL, "--json"],
                capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=seconds + 180)
            if load.returncode != 0:
                raise RuntimeError(f"bench load failed: {load.stderr[-2000:]}")
            summary = json.loads(load.stdout)
            out[policy] = {"sent": summary["sent"], "completed": summary["completed"], "errors": summary["errors"],
                           "ttft_p50_s": summary["ttft_s"]["p50"], "ttft_p99_s": summary["ttft_s"]["p99"],
                           "e2e_p99_s": summary["e2e_s"]["p99"], "goodput_rps": summary["goodput_rps"],
                           "goodput_ratio": summary["goodput_ratio"]}
            print(policy, out[policy], flush=True)
        finally:
            for proc in reversed(procs):
                proc.stop()
    return {"seconds": seconds, "rate": rate, "trace": trace, "ttft_slo_s": slo, "degraded": f"engine 3: {faults}",
            "policies": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    null = sub.add_parser("null-upstream")
    null.add_argument("--port", type=int, required=True)
    empty = sub.add_parser("empty-ext-proc")
    empty.add_argument("--port", type=int, required=True)
    empty.add_argument("--upstream", required=True)
    for name in ("latency", "throughput", "routing", "all"):
        p = sub.add_parser(name)
        p.add_argument("--requests", type=int, default=2000, help="latency: timed requests per path")
        p.add_argument("--seconds", type=float, default=None, help="throughput (10) / routing (40) run length")
        p.add_argument("--concurrency", type=int, default=32, help="throughput: concurrent gRPC streams")
        p.add_argument("--rate", type=float, default=8.0, help="routing: arrivals per second")
        p.add_argument("--slo", type=float, default=2.0, help="routing: TTFT SLO for goodput, seconds")
        p.add_argument("--trace", default="azure2023_conv", help="routing: trace for `llmdiag bench load`")
    args = parser.parse_args()
    if args.what == "null-upstream":
        serve_null(args.port)
        return
    if args.what == "empty-ext-proc":
        serve_empty_ext_proc(args.port, args.upstream)
        return
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    with tempfile.TemporaryDirectory(prefix="bench-picker-") as tmp_name:
        tmp = Path(tmp_name)
        if args.what in ("latency", "all"):
            load_before = os.getloadavg()[0]
            results["latency"] = bench_latency(tmp, args.requests)
            # Other jobs on the machine inflate every path; the load average says how much was going on.
            results["latency"]["load_average_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
            print(json.dumps(results["latency"], indent=1), flush=True)
        if args.what in ("throughput", "all"):
            results["throughput"] = bench_throughput(tmp, args.seconds or 10.0, args.concurrency)
            print(json.dumps(results["throughput"], indent=1), flush=True)
        if args.what in ("routing", "all"):
            results["routing"] = bench_routing(tmp, args.seconds or 40.0, args.rate, args.slo, args.trace)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    results["machine"] = f"{os.cpu_count()} cores, {sys.version.split()[0]}"
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()

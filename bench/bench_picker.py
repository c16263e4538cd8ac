"""The Envoy endpoint picker, measured with a real Envoy 1.40 on loopback.

    PYTHONPATH=. .venv/bin/python bench/bench_picker.py all            # everything below, ~4 min
    PYTHONPATH=. .venv/bin/python bench/bench_picker.py latency --requests 2000
    PYTHONPATH=. .venv/bin/python bench/bench_picker.py throughput --seconds 10
    PYTHONPATH=. .venv/bin/python bench/bench_picker.py routing --seconds 40 --rate 8

- ``latency``: added latency of one small JSON POST, sequential on one
  keep-alive connection, for three paths to the same trivial upstream (an
  aiohttp server answering at once): direct; Envoy round robin; Envoy + the
  picker. Rounds alternate the paths so that noise from other jobs on the
  machine spreads evenly. Also the same through a 16-chunk SSE answer, where
  the picker sees every chunk.
- ``throughput``: the picker alone, pinned to one core, driven over gRPC by
  a client pinned to the other with the messages Envoy sends for one
  non-streamed request (request headers, buffered body, response headers);
  requests/s, and requests per CPU-second of the picker (its capacity on one
  fully busy core, whichever side was the limit).
- ``routing``: four fake engines, one degraded 5 s in (steps 4x slower, KV
  cache 10 %), Poisson arrivals of streamed completions (prompt 200-2000
  tokens, 32-96 output tokens, fixed seed); Envoy + picker against Envoy's
  ``round_robin`` and ``least_request`` on fresh engines each: TTFT p50/p99,
  E2E p99 and goodput (requests/s finished with TTFT <= 1 s).

Results: ``bench/results/picker.json`` and the tables printed (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import math
import os
import random
import statistics
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
    try:
        null_port = free_port()
        null = Proc([sys.executable, __file__, "null-upstream", "--port", str(null_port)], tmp / "null.log",
                    {**os.environ, "PYTHONPATH": str(REPO)})
        procs.append(null)
        wait_http(f"http://127.0.0.1:{null_port}/health", 20, null)
        grpc_port, metrics_port = free_port(), free_port()
        procs.append(start_picker(tmp, [f"http://127.0.0.1:{null_port}"], grpc_port, metrics_port))
        envoy_rr, rr_port, _ = start_envoy(tmp, "round_robin", endpoints=(f"127.0.0.1:{null_port}",), name="envoy-rr")
        procs.append(envoy_rr)
        envoy_pk, pk_port, _ = start_envoy(tmp, "picker", picker_port=grpc_port, name="envoy-picker")
        procs.append(envoy_pk)
        paths = {"direct": null_port, "envoy_round_robin": rr_port, "envoy_picker": pk_port}
        out: dict[str, dict] = {}
        for stream in (False, True):
            samples: dict[str, list[float]] = {p: [] for p in paths}
            per_round = max(50, requests // rounds)
            for port in paths.values():
                _timed_posts(port, 200, stream)  # warm-up: connections, caches, the picker's reply cache
            for _ in range(rounds):
                for name, port in paths.items():
                    samples[name] += _timed_posts(port, per_round, stream)
            kind = "sse_16_chunks" if stream else "json"
            out[kind] = {name: _percentiles(v) for name, v in samples.items()}
            rr, pk = out[kind]["envoy_round_robin"], out[kind]["envoy_picker"]
            out[kind]["picker_added_over_round_robin_ms"] = {
                "p50": round(pk["p50_ms"] - rr["p50_ms"], 3), "p99": round(pk["p99_ms"] - rr["p99_ms"], 3)}
        return out
    finally:
        for proc in reversed(procs):
            proc.stop()


# ---------------------------------------------------------------- picker throughput


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _drive(port: int, seconds: float, concurrency: int) -> int:
    import grpc
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    def headers(pairs: dict[str, str], response: bool) -> pb.ProcessingRequest:
        h = pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
            base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]))
        return pb.ProcessingRequest(response_headers=h) if response else pb.ProcessingRequest(request_headers=h)

    body = json.dumps({"model": MODEL, "prompt": "x" * 2000, "max_tokens": 64}).encode()
    messages = [headers({":method": "POST", ":path": "/v1/completions", "content-type": "application/json"}, False),
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
        asyncio.run(_drive(grpc_port, 1.0, concurrency))  # warm-up
        cpu0, t0 = _cpu_seconds(picker.popen.pid), time.monotonic()
        done = asyncio.run(_drive(grpc_port, seconds, concurrency))
        cpu1, t1 = _cpu_seconds(picker.popen.pid), time.monotonic()
        return {"requests": done, "seconds": round(t1 - t0, 2), "requests_per_second": round(done / (t1 - t0)),
                "picker_cpu_seconds": round(cpu1 - cpu0, 2),
                "requests_per_picker_cpu_second": round(done / max(1e-9, cpu1 - cpu0)),
                "concurrency": concurrency, "pinned_one_core_each": bool(pinned)}
    finally:
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
        for proc in reversed(procs):
            proc.stop()


# ---------------------------------------------------------------- routing on live engines


async def _load(url: str, seconds: float, rate: float, seed: int) -> list[dict]:
    import aiohttp

    rng = random.Random(seed)
    results: list[dict] = []

    async def one(prompt: int, output: int) -> None:
        body = {"model": MODEL, "prompt_tokens": prompt, "max_tokens": output, "stream": True}
        start = time.monotonic()
        first = None
        status = 0
        try:
            async with session.post(url, json=body) as resp:
                status = resp.status
                async for chunk in resp.content.iter_any():
                    if first is None and chunk:
                        first = time.monotonic() - start
        except (aiohttp.ClientError, asyncio.TimeoutError):
            status = -1
        results.append({"status": status, "ttft": first, "e2e": time.monotonic() - start})

    tasks = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        t = time.monotonic()
        end = t + seconds
        while t < end:
            t += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, t - time.monotonic()))
            prompt = int(min(2000, max(200, rng.lognormvariate(math.log(700), 0.6))))
            tasks.append(asyncio.create_task(one(prompt, rng.randint(32, 96))))
        await asyncio.gather(*tasks)
    return results


def _summary(results: list[dict], seconds: float, slo: float) -> dict:
    ok = [r for r in results if r["status"] == 200 and r["ttft"] is not None]
    ttft = sorted(r["ttft"] for r in ok)
    e2e = sorted(r["e2e"] for r in ok)
    def q(values: list[float], p: float) -> float | None:
        return round(values[min(len(values) - 1, int(p * len(values)))], 3) if values else None
    return {"requests": len(results), "errors": len(results) - len(ok), "ttft_p50_s": q(ttft, 0.5),
            "ttft_p99_s": q(ttft, 0.99), "e2e_p99_s": q(e2e, 0.99),
            "goodput_rps": round(sum(1 for r in ok if r["ttft"] <= slo) / seconds, 2),
            "within_slo": round(sum(1 for r in ok if r["ttft"] <= slo) / max(1, len(results)), 3)}


def bench_routing(tmp: Path, seconds: float, rate: float, slo: float, seed: int) -> dict:
    out = {}
    faults = "slowdown:start=5,speed=0.25;kv_shrink:start=5,factor=0.1"
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
            results = asyncio.run(_load(f"http://127.0.0.1:{listen}/v1/completions", seconds, rate, seed))
            out[policy] = _summary(results, seconds, slo)
            print(policy, out[policy], flush=True)
        finally:
            for proc in reversed(procs):
                proc.stop()
    return {"seconds": seconds, "rate": rate, "ttft_slo_s": slo, "degraded": f"engine 3: {faults}", "policies": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    null = sub.add_parser("null-upstream")
    null.add_argument("--port", type=int, required=True)
    for name in ("latency", "throughput", "routing", "all"):
        p = sub.add_parser(name)
        p.add_argument("--requests", type=int, default=2000, help="latency: timed requests per path")
        p.add_argument("--seconds", type=float, default=None, help="throughput (10) / routing (40) run length")
        p.add_argument("--concurrency", type=int, default=32, help="throughput: concurrent gRPC streams")
        p.add_argument("--rate", type=float, default=8.0, help="routing: arrivals per second")
        p.add_argument("--slo", type=float, default=1.0, help="routing: TTFT SLO for goodput, seconds")
        p.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if args.what == "null-upstream":
        serve_null(args.port)
        return
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    with tempfile.TemporaryDirectory(prefix="bench-picker-") as tmp_name:
        tmp = Path(tmp_name)
        if args.what in ("latency", "all"):
            results["latency"] = bench_latency(tmp, args.requests)
            print(json.dumps(results["latency"], indent=1), flush=True)
        if args.what in ("throughput", "all"):
            results["throughput"] = bench_throughput(tmp, args.seconds or 10.0, args.concurrency)
            print(json.dumps(results["throughput"], indent=1), flush=True)
        if args.what in ("routing", "all"):
            results["routing"] = bench_routing(tmp, args.seconds or 40.0, args.rate, args.slo, args.seed)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    results["machine"] = f"{os.cpu_count()} cores, {sys.version.split()[0]}"
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""``llmdiag gateway`` against fake engines and scripted upstreams on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter

import aiohttp
import pytest
from aiohttp import web

from llmdiag.config.balancer import BalancerConfig, ScoreConfig
from llmdiag.gateway.proxy import BACKEND_HEADER
from llmdiag.model import Backend, BackendState
from llmdiag.router_feedback.balancer import Balancer

from gateway_support import MODEL, Scripted, aborts, gateway, normalise_ids, start_engine

pytestmark = pytest.mark.integration

# Chunks cut at awkward places: inside a JSON string, inside a UTF-8 character, across event boundaries.
SSE_CHUNKS = [
    b'data: {"choices":[{"text":"h',
    b'\xc3',
    b'\xa9llo"}]}\n',
    b'\ndata: {"choices":[{"text":" w"}]}\n\ndata: {"choi',
    b'ces":[{"text":"orld","finish_reason":"length"}]}\n\n',
    b"data: [DONE]\n\n",
]


async def _stepwise_sse(request: web.Request, upstream: Scripted) -> web.StreamResponse:
    """Sends chunk i+1 only after the test saw chunk i arrive at the client: proves nothing is buffered."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Engine": "scripted"})
    await resp.prepare(request)
    for chunk in SSE_CHUNKS:
        await resp.write(chunk)
        upstream.release.clear()
        await asyncio.wait_for(upstream.release.wait(), 5.0)
    await resp.write_eof()
    return resp


async def test_streaming_is_byte_identical_and_unbuffered() -> None:
    upstream = await Scripted(_stepwise_sse).start()
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True}
    try:
        async with gateway([Backend("s", upstream.url)]) as gw, aiohttp.ClientSession(auto_decompress=False) as session:
            results = {}
            for via in (upstream.url, gw.url):
                received = b""
                async with session.post(f"{via}/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    headers = resp.headers
                    while True:
                        chunk = await asyncio.wait_for(resp.content.readany(), 5.0)
                        if not chunk:
                            break
                        received += chunk
                        if len(received) >= sum(map(len, SSE_CHUNKS[: _count_complete(received)])):
                            upstream.release.set()
                results[via] = (received, headers)
            direct, through = results[upstream.url], results[gw.url]
            assert through[0] == direct[0] == b"".join(SSE_CHUNKS)
            assert through[1]["X-Engine"] == "scripted"
            assert through[1]["Content-Type"] == "text/event-stream"
            assert through[1][BACKEND_HEADER] == "s"
        # The gateway forwarded the client's bytes unchanged.
        assert upstream.bodies[0] == upstream.bodies[1]
    finally:
        await upstream.stop()


def _count_complete(received: bytes) -> int:
    total, n = 0, 0
    for chunk in SSE_CHUNKS:
        total += len(chunk)
        if len(received) >= total:
            n += 1
    return n


async def test_fake_engine_stream_through_gateway_matches_direct() -> None:
    engine = await start_engine()
    try:
        async with gateway([Backend("e", engine.url)]) as gw, aiohttp.ClientSession() as session:
            out = {}
            for path in ("/v1/completions", "/v1/chat/completions"):
                body = ({"model": MODEL, "messages": [{"role": "user", "content": "hello"}]} if "chat" in path
                        else {"model": MODEL, "prompt": "hello"}) | {"max_tokens": 12, "stream": True}
                for via in (engine.url, gw.url):
                    async with session.post(via + path, json=body) as resp:
                        out[(path, via)] = normalise_ids(await resp.read())
                assert out[(path, gw.url)] == out[(path, engine.url)]
                assert out[(path, gw.url)].count(b"data: ") == 12 + 2  # tokens, the usage chunk, [DONE]
            async with session.get(gw.url + "/v1/models") as resp:
                assert [m["id"] for m in (await resp.json())["data"]] == [MODEL]
    finally:
        await engine.stop()


async def test_degraded_backend_share_falls_and_comes_back() -> None:
    # e2 runs at 1/20 speed from t=3 s to t=8 s. TTFT observations older than 2 s are dropped
    # (ttft_stale_seconds), so once it recovers and its old slow TTFTs age out it gets work again.
    engines = [await start_engine(), await start_engine(), await start_engine("slowdown:start=3,duration=5,speed=0.05")]
    cfg = BalancerConfig(score=ScoreConfig(ttft_stale_seconds=2.0, warming_start_score=100.0))
    t0 = time.monotonic()
    picks: list[tuple[float, str]] = []
    try:
        async with gateway([Backend(f"e{i}", e.url) for i, e in enumerate(engines)], cfg) as gw, \
                aiohttp.ClientSession() as session:

            async def client() -> None:
                body = {"model": MODEL, "prompt_tokens": 256, "max_tokens": 8, "stream": True}
                while time.monotonic() - t0 < 13.0:
                    sent = time.monotonic() - t0
                    async with session.post(gw.url + "/v1/completions", json=body) as resp:
                        assert resp.status == 200
                        await resp.read()
                        picks.append((sent, resp.headers[BACKEND_HEADER]))

            await asyncio.gather(*(client() for _ in range(6)))
    finally:
        for e in engines:
            await e.stop()

    def share(lo: float, hi: float) -> float:
        window = [b for t, b in picks if lo <= t < hi]
        assert len(window) >= 10, (lo, hi, len(window))
        return Counter(window)["e2"] / len(window)

    before, during, after = share(0.0, 3.0), share(4.5, 8.0), share(10.5, 13.0)
    assert before > 0.2, before
    assert during < 0.5 * before, (before, during)
    assert after > 2 * during and after > 0.15, (during, after)


def _answer(status: int, body: str, headers: dict | None = None):
    async def handler(request: web.Request, upstream: Scripted) -> web.StreamResponse:
        return web.Response(status=status, text=body, content_type="application/json", headers=headers)
    return handler


KV_429 = '{"object":"error","code":429,"message":"KV cache exhausted: no free blocks"}'
QUOTA_429 = '{"error":{"message":"Rate limit exceeded for api key sk-123","type":"rate_limit","code":429}}'


async def test_kv_exhausted_429_cools_and_retries_elsewhere() -> None:
    bad = await Scripted(_answer(429, KV_429)).start()
    engine = await start_engine()
    try:
        # choices=0 (full scan) + in-flight penalty: the idle "bad" is tried first sooner or later.
        async with gateway([Backend("bad", bad.url), Backend("good", engine.url)]) as gw, aiohttp.ClientSession() as session:
            for _ in range(20):
                async with session.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}) as resp:
                    assert resp.status == 200  # the 429 never reaches the client: retried on "good"
                    assert resp.headers[BACKEND_HEADER] == "good"
                if bad.bodies:
                    break
            assert bad.bodies, "the saturated backend was never picked"
            assert gw.balancer.state("bad") is BackendState.COOLING
            assert gw.balancer.counters["cooling_enforced_total"] == 1
            assert gw.balancer.counters["responses_saturated_total"] == 1
    finally:
        await bad.stop()
        await engine.stop()


async def test_api_key_quota_429_is_passed_through_and_not_held_against_the_backend() -> None:
    quota = await Scripted(_answer(429, QUOTA_429, {"Retry-After": "7"})).start()
    try:
        async with gateway([Backend("q", quota.url)]) as gw, aiohttp.ClientSession() as session:
            for _ in range(5):
                async with session.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}) as resp:
                    assert resp.status == 429
                    assert await resp.text() == QUOTA_429
                    assert resp.headers["Retry-After"] == "7"
            assert len(quota.bodies) == 5  # not retried (there is nowhere else), not cooled, not ejected
            assert gw.balancer.state("q") not in (BackendState.COOLING, BackendState.EJECTED)
            assert gw.balancer.counters["responses_client_ratelimit_total"] == 5
            assert gw.balancer.counters["cooling_enforced_total"] == 0
    finally:
        await quota.stop()


async def test_crashed_backend_is_ejected_then_readmitted_after_probes() -> None:
    # e1 crashes at t=1.5 s for 3 s (connections refused), then restarts warm.
    engines = [await start_engine(), await start_engine("crash:start=1.5,down=3,warmup_s=0")]
    cfg = BalancerConfig(probe_ejected_interval_seconds=0.5, probe_interval_seconds=30.0,
                         score=ScoreConfig(warming_start_score=100.0))
    t0 = time.monotonic()
    statuses: Counter[int] = Counter()
    picks: list[tuple[float, str]] = []
    states: set[BackendState] = set()
    try:
        async with gateway([Backend(f"e{i}", e.url) for i, e in enumerate(engines)], cfg, probes=True) as gw, \
                aiohttp.ClientSession() as session:

            async def client() -> None:
                while time.monotonic() - t0 < 9.0:
                    sent = time.monotonic() - t0
                    async with session.post(gw.url + "/v1/completions",
                                            json={"model": MODEL, "prompt": "x", "max_tokens": 4}) as resp:
                        await resp.read()
                        statuses[resp.status] += 1
                        picks.append((sent, resp.headers[BACKEND_HEADER]))
                    states.add(gw.balancer.state("e1"))
                    await asyncio.sleep(0.02)

            await asyncio.gather(*(client() for _ in range(3)))
            assert gw.balancer.counters["ejections_total"] >= 1
    finally:
        for e in engines:
            await e.stop()
    # Connect errors were retried on e0; only requests inside e1 when it died got its 500 (at most one per client).
    assert set(statuses) <= {200, 500} and statuses[500] <= 3, statuses
    assert BackendState.EJECTED in states
    assert any(b == "e1" for t, b in picks if t > 6.0), "e1 never came back"
    assert not any(b == "e1" for t, b in picks if 2.0 < t < 4.4)


async def test_client_disconnect_cancels_upstream() -> None:
    engine = await start_engine()
    try:
        async with gateway([Backend("e", engine.url)]) as gw:
            # Mid-stream: read two chunks of a long generation, then hang up.
            async with aiohttp.ClientSession() as session:
                resp = await session.post(gw.url + "/v1/completions",
                                          json={"model": MODEL, "prompt": "x", "max_tokens": 100_000, "stream": True})
                await resp.content.readline()
                await resp.content.readline()
                resp.close()
            await _wait_for(lambda: aborts(engine) >= 1)
            # Before any token: the engine is stalled; the client gives up after 0.3 s. Streamed, the
            # engine has sent its headers; not streamed, the gateway is still waiting for them.
            engine.model.stall_until = engine.now() + 30.0
            for n, stream in enumerate((True, False), start=2):
                async with aiohttp.ClientSession() as session:
                    with pytest.raises(asyncio.TimeoutError):
                        async with asyncio.timeout(0.3):
                            resp = await session.post(gw.url + "/v1/completions",
                                                      json={"model": MODEL, "prompt": "x", "stream": stream})
                            await resp.content.readany()
                await _wait_for(lambda: aborts(engine) >= n)
            await _wait_for(lambda: gw.balancer.load("e") == 0)
            assert gw.metrics.client_disconnects._value.get() == 3
            assert gw.balancer.counters["responses_client_error_total"] == 3  # 499: not the backend's fault
            assert gw.balancer.state("e") is not BackendState.EJECTED
    finally:
        await engine.stop()


async def _wait_for(condition, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


async def _hang(request: web.Request, upstream: Scripted) -> web.StreamResponse:
    await upstream.release.wait()
    return web.Response(text="late")


@pytest.mark.parametrize("shadow_kind", ["hanging", "500", "refused"])
async def test_mirroring_never_changes_the_client_response(shadow_kind: str) -> None:
    engine = await start_engine()
    shadow = None
    if shadow_kind == "hanging":
        shadow = await Scripted(_hang).start()
        shadow_url = shadow.url
    elif shadow_kind == "500":
        shadow = await Scripted(_answer(500, '{"error":"shadow broke"}')).start()
        shadow_url = shadow.url
    else:
        import socket

        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        shadow_url = f"http://127.0.0.1:{s.getsockname()[1]}"
        s.close()
    bodies = [{"model": MODEL, "prompt": f"p{i}", "max_tokens": 5, "stream": i % 2 == 0} for i in range(6)]
    try:
        answers = {}
        for mirrored in (False, True):
            extra = {"mirror_url": shadow_url, "mirror_fraction": 1.0, "mirror_max_in_flight": 4} if mirrored else {}
            async with gateway([Backend("e", engine.url)], **extra) as gw, aiohttp.ClientSession() as session:
                got = []
                for body in bodies:
                    async with asyncio.timeout(5.0):  # a hanging shadow must not delay anyone
                        async with session.post(gw.url + "/v1/completions", json=body) as resp:
                            got.append((resp.status, resp.headers["Content-Type"], normalise_ids(await resp.read())))
                answers[mirrored] = got
                if mirrored:
                    outcomes = gw.mirror.outcomes
                    if shadow_kind == "hanging":
                        assert outcomes["sent"] == 4 and outcomes["dropped"] == 2  # bounded in-flight copies
                        assert [json.loads(b) for b in shadow.bodies] == bodies[:4]
                    else:
                        await _wait_for(lambda: outcomes["error"] == 6)
        assert answers[True] == answers[False]
    finally:
        await engine.stop()
        if shadow is not None:
            await shadow.stop()


async def test_bench_load_through_the_gateway_reports_per_backend(tmp_path) -> None:
    import os
    import sys

    engines = [await start_engine(), await start_engine()]
    trace = tmp_path / "trace.csv"
    trace.write_text("arrival_s,input_tokens,output_tokens\n" + "".join(f"{i * 0.5},{200 + i},{4 + i % 3}\n" for i in range(12)))
    try:
        async with gateway([Backend(f"e{i}", e.url) for i, e in enumerate(engines)]) as gw:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "llmdiag.cli", "bench", "load", "--target", gw.url, "--trace", str(trace),
                "--rate", "6", "--duration", "2", "--json", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                env={**os.environ, "PYTHONPATH": os.getcwd()})
            out, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        for e in engines:
            await e.stop()
    assert proc.returncode == 0, err.decode()
    summary = json.loads(out)
    assert summary["sent"] == summary["completed"] == 12 and summary["errors"] == {}
    assert summary["ttft_s"]["p50"] > 0 and summary["itl_s"]["p50"] > 0
    assert sum(summary["backends"].values()) == 12 and set(summary["backends"]) <= {"e0", "e1"}
    assert summary["goodput_ratio"] == 1.0


async def test_engine_metrics_reach_the_balancer() -> None:
    from llmdiag.gateway.engine_signals import EngineSignals

    # A 4,000-token KV cache holds two 1,500-token prompts: the rest of 40 requests wait.
    calm, busy = await start_engine(), await start_engine(kv_capacity_tokens=4000)
    silent = await Scripted(_answer(200, "{}")).start()  # an OpenAI server without /metrics
    balancer = Balancer([Backend("calm", calm.url), Backend("busy", busy.url), Backend("silent", silent.url)],
                        BalancerConfig(score=ScoreConfig(warming_start_score=100.0)))
    signals = EngineSignals(balancer)
    try:
        async with aiohttp.ClientSession() as session:
            body = {"model": MODEL, "prompt_tokens": 1500, "max_tokens": 100_000}
            waiting = [asyncio.create_task(session.post(busy.url + "/v1/completions", json=body)) for _ in range(40)]
            await _wait_for(lambda: busy.model.num_waiting >= 35)
            got = await asyncio.get_running_loop().run_in_executor(None, signals.collect_once)
            for task in waiting:
                task.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)
    finally:
        await calm.stop()
        await busy.stop()
        await silent.stop()
    assert got["busy"]["requests_waiting"] >= 35
    assert got["calm"]["requests_waiting"] == 0 and got["calm"]["up"] == 1
    assert got["silent"] == {"up": 0}  # a failed scrape is unknown, not zero
    assert balancer.score("busy") < balancer.score("calm") - 10


def _timewait_to(port: int) -> int:
    """TIME_WAIT sockets (state 06) whose remote port is ``port``, from /proc/net/tcp{,6}."""
    count = 0
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(path).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "06" and int(fields[2].rsplit(":", 1)[1], 16) == port:
                count += 1
    return count


async def test_pooled_connections_leave_no_time_wait_and_metrics_are_valid(tmp_path) -> None:
    import shutil
    import subprocess

    engine = await start_engine()
    try:
        before = _timewait_to(engine.port)
        async with gateway([Backend("e", engine.url)]) as gw, aiohttp.ClientSession() as session:
            for i in range(60):
                body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": i % 2 == 0}
                async with session.post(gw.url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    await resp.read()
            # 60 requests over pooled keep-alive connections: a connection per request would leave 60
            # sockets in TIME_WAIT toward the engine (the margin is for other tests' closing sockets).
            assert _timewait_to(engine.port) - before < 5
            async with session.get(gw.url + "/metrics") as resp:
                text = await resp.text()
        assert 'llmdiag_gateway_requests_total{class="ok",endpoint="/v1/completions"} 60.0' in text
        assert 'llmdiag_gateway_picks_total{backend="e"} 60.0' in text
        assert 'llmdiag_gateway_ttft_seconds_count{backend="e"} 30.0' in text  # the streamed half
        assert "llmdiag_gateway_decision_seconds_bucket" in text
        promtool = shutil.which("promtool")
        if promtool:
            check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
            assert check.returncode == 0, check.stdout + check.stderr
    finally:
        await engine.stop()


BIG = bytes(range(256)) * 32 * 1024  # 8 MiB: far more than the gateway's 1 MiB client high-water mark


async def _big_stream(request: web.Request, upstream: Scripted) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(0, len(BIG), 64 * 1024):
        await resp.write(BIG[i:i + 64 * 1024])
    await resp.write_eof()
    return resp


async def test_a_slow_client_pauses_the_backend_and_gets_every_byte(monkeypatch: pytest.MonkeyPatch) -> None:
    from llmdiag.gateway.upstream import UpstreamConnection

    pauses = 0
    original = UpstreamConnection.pause

    def counting_pause(self: UpstreamConnection) -> None:
        nonlocal pauses
        pauses += 1
        original(self)

    monkeypatch.setattr(UpstreamConnection, "pause", counting_pause)
    upstream = await Scripted(_big_stream).start()
    try:
        async with gateway([Backend("s", upstream.url)]) as gw, aiohttp.ClientSession(auto_decompress=False) as session:
            async with session.post(gw.url + "/v1/completions", json={"model": MODEL, "stream": True}) as resp:
                await asyncio.sleep(0.5)  # not reading: the gateway's buffer toward us fills up
                received = await asyncio.wait_for(resp.read(), 20)
            assert received == BIG
            assert pauses >= 1  # the backend was paused, not buffered without bound
            assert gw.balancer.load("s") == 0
    finally:
        await upstream.stop()

"""The fake engine: the engine model driven by the wall clock behind a real HTTP server.

It speaks enough of vLLM's OpenAI-compatible API for gateways, load
generators and llmdiag's own collectors to treat it as an engine:

- ``POST /v1/completions`` and ``POST /v1/chat/completions``, streaming (SSE,
  one chunk per generated token, then ``data: [DONE]``) or not;
- ``GET /v1/models``, ``GET /health`` (200 while the process is up, whatever
  the KV cache and queue look like: the *false healthy* that llmdiag exists
  to see through);
- ``GET /metrics`` in Prometheus text format with vLLM V1 names
  (``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``,
  ``vllm:time_to_first_token_seconds`` ...), labels ``model_name`` and
  ``engine``, and the API server's ``http_requests_total{handler,method,status}``
  with statuses grouped ``2xx``/``4xx``/``5xx``, as vLLM's
  prometheus-fastapi-instrumentator counts them (``/metrics`` and ``/health``
  are not counted), and ``process_start_time_seconds`` (Unix time), which
  here is the instant the engine clock started: fault times count from it, so
  a benchmark can line its load up with a scheduled fault.

Token counts: a request may give ``prompt_tokens`` (an extension field; load
generators replaying traces use it), else the prompt is counted as one token
per 4 characters. ``max_tokens`` (default 16) is generated in full.

Faults (:mod:`llmdiag.sim.faults`, ``--faults`` text form) start counting at
server start. A crash really closes the listening socket (clients get
connection refused) and reopens it after the down time.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from llmdiag.sim.engine_model import CRASH_BODY, DECODE, PRESETS, WAITING, EngineModel, SimRequest
from llmdiag.sim.faults import FaultSchedule

if TYPE_CHECKING:
    from llmdiag.sim.fake_engine_grpc import GrpcFrontend

__all__ = ["FakeEngine", "FakeEngineOptions"]

log = logging.getLogger("llmdiag.fake_engine")

# vLLM V1's bucket boundaries (vllm/v1/metrics/loggers.py), so that scrapes look like the real thing.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
#: vLLM's iteration_tokens_total buckets (cudagraph capture sizes up to max_num_batched_tokens).
ITERATION_BUCKETS = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0)
BLOCK_SIZE = 16


@dataclass(frozen=True)
class FakeEngineOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    model: str = "fake/llama3-8b"
    profile: str = "llama3-8b-h100"
    kv_capacity_tokens: int | None = None
    queue_limit: int | None = None
    faults: FaultSchedule = field(default_factory=FaultSchedule)
    engine_label: str = "0"
    seed: int = 0
    #: also serve the h2c gRPC streaming Generate method on this port (0 picks one; None: no gRPC)
    grpc_port: int | None = None

    def __post_init__(self) -> None:
        if self.profile not in PRESETS:
            raise ValueError(f"unknown profile {self.profile!r} (known: {', '.join(PRESETS)})")


class _Stream:
    """A request's link between the engine loop and its HTTP handler."""

    __slots__ = ("req", "queue", "sent", "arrival", "first_at", "last_at", "admitted_at")

    def __init__(self, req: SimRequest, arrival: float) -> None:
        self.req = req
        self.queue: asyncio.Queue[int | None] = asyncio.Queue()
        self.sent = 0
        self.arrival = arrival
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.admitted_at: float | None = None


class _GaugeCollector(Collector):
    """Engine state gauges, read from the model at scrape time."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine

    def collect(self):  # type: ignore[no-untyped-def]
        e = self.engine
        labels = ["model_name", "engine"]
        values = [e.options.model, e.options.engine_label]
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", e.model.num_running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", e.model.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", e.model.kv_usage),
        ):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, float(value))
            yield g
        # vLLM has it from prometheus_client's process collector; here it is the engine clock's
        # start, the origin of the fault schedule (a load generator lines its schedule up with it).
        start = GaugeMetricFamily("process_start_time_seconds", "Start time of the process since unix epoch in seconds.")
        start.add_metric([], e.started_at_unix)
        yield start
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=["block_size", "num_gpu_blocks", "engine"])
        info.add_metric([str(BLOCK_SIZE), str(e.model.kv_capacity_nominal // BLOCK_SIZE), e.options.engine_label], 1.0)
        yield info


class FakeEngine:
    """One fake engine process: model + wall-clock loop + HTTP server."""

    def __init__(self, options: FakeEngineOptions, clock: Callable[[], float] = time.monotonic) -> None:
        self.options = options
        self.clock = clock
        self.model = EngineModel(
            PRESETS[options.profile], kv_capacity_tokens=options.kv_capacity_tokens,
            queue_limit=options.queue_limit, seed=options.seed, name=options.model,
        )
        self._streams: dict[int, _Stream] = {}
        self._ids = itertools.count(1)
        self._wake = asyncio.Event()
        self._t0 = 0.0
        self.started_at_unix = 0.0  # wall-clock time of self._t0 (process_start_time_seconds)
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.port = options.port
        self.grpc: GrpcFrontend | None = None
        self.grpc_port: int | None = None
        self._build_metrics()

    def _build_metrics(self) -> None:
        """A fresh registry: at start, and after a crash (a restarted vLLM starts its counters at zero)."""
        options = self.options
        self.registry = reg = CollectorRegistry()
        labels = ["model_name", "engine"]
        lv = (options.model, options.engine_label)
        self._preemptions = Counter("vllm:num_preemptions", "Cumulative number of preemptions.", labels, registry=reg).labels(*lv)
        self._prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=reg).labels(*lv)
        self._gen_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.", labels, registry=reg).labels(*lv)
        self._success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                labels + ["finished_reason"], registry=reg)
        self._ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                               labels, buckets=TTFT_BUCKETS, registry=reg).labels(*lv)
        self._itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                              labels, buckets=ITL_BUCKETS, registry=reg).labels(*lv)
        self._e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                              labels, buckets=E2E_BUCKETS, registry=reg).labels(*lv)
        # vLLM observes the tokens of every engine step here: its count is the steps taken.
        self._iteration_tokens = Histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                           labels, buckets=ITERATION_BUCKETS, registry=reg).labels(*lv)
        self._queue_time = Histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase.",
                                     labels, buckets=E2E_BUCKETS, registry=reg).labels(*lv)
        # vLLM's API server: Instrumentator(excluded_handlers=["/metrics", "/health", ...]) with
        # status codes grouped, counted when the response (a whole stream) is done.
        self._http_requests = Counter("http_requests", "Total number of requests by method, status and handler.",
                                      ["handler", "method", "status"], registry=reg)
        reg.register(_GaugeCollector(self))
        self._preemptions_seen = self.model.preemptions_total

    # ----------------------------------------------------------------- server
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._count_http_requests])
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._completions)
        return app

    async def start(self) -> None:
        """Bind the port (0 picks one: see :attr:`port`) and start the engine loop."""
        self._t0 = self.clock()
        self.started_at_unix = time.time()
        await self._listen()
        if self.options.grpc_port is not None:
            from llmdiag.sim.fake_engine_grpc import GrpcFrontend  # noqa: PLC0415 - grpcio only when asked

            self.grpc = GrpcFrontend(self)
            self.grpc_port = await self.grpc.start(self.options.host, self.options.grpc_port)
        self._tasks = [asyncio.create_task(self._engine_loop()), asyncio.create_task(self._fault_loop())]

    async def _listen(self) -> None:
        # handler_cancellation: a client that hangs up cancels its handler at once (aiohttp no
        # longer does by default), so its request is aborted in the engine as vLLM does, even
        # while it is still waiting and nothing is being written to it.
        self._runner = web.AppRunner(self.app(), access_log=None, shutdown_timeout=0.2, handler_cancellation=True)
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, self.options.host, self.port, reuse_address=True)
        await self._site.start()
        sockets = self._site._server.sockets if self._site._server else []  # type: ignore[union-attr]
        if sockets:
            self.port = sockets[0].getsockname()[1]

    async def _die(self) -> None:
        """What a crashed process looks like from outside: the port and every open connection close."""
        if self._runner is not None:
            await self._runner.cleanup()
        self._runner = self._site = None

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        for stream in list(self._streams.values()):
            stream.queue.put_nowait(None)
        if self.grpc is not None:
            await self.grpc.stop()
        await self._die()

    @property
    def url(self) -> str:
        return f"http://{self.options.host}:{self.port}"

    def now(self) -> float:
        """Seconds since start: the engine model's and the fault schedule's time axis."""
        return self.clock() - self._t0

    @web.middleware
    async def _count_http_requests(self, request: web.Request, handler):  # type: ignore[no-untyped-def]
        resource = request.match_info.route.resource
        path = resource.canonical if resource is not None else None
        if path in (None, "/metrics", "/health"):
            return await handler(request)
        status: int | None = None  # stays None for a cancelled handler (client gone): not counted
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        except Exception:
            status = 500  # aiohttp answers an unhandled exception with a 500
            raise
        finally:
            if status is not None:
                self._http_requests.labels(path, request.method, f"{status // 100}xx").inc()

    # --------------------------------------------------------------- handlers
    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type-Options": "nosniff"})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.options.model, "object": "model", "owned_by": "llmdiag-fake-engine",
             "max_model_len": self.model.kv_capacity_nominal}]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("body must be a JSON object")
            prompt_tokens, max_tokens = _token_counts(body)
        except (ValueError, json.JSONDecodeError) as exc:
            return _error(400, "BadRequestError", f"invalid request: {exc}")
        if body.get("model") not in (None, self.options.model):
            return _error(404, "NotFoundError", f"The model `{body.get('model')}` does not exist.")
        chat = request.path.endswith("/chat/completions")
        rid = next(self._ids)
        req = SimRequest(rid, prompt_tokens, max_tokens, arrival=self.now())
        answer = self.model.submit(req, self.now())
        if not answer.accepted:
            status = answer.status or 500
            return web.Response(status=status, text=answer.body, content_type="application/json")
        stream = _Stream(req, self.now())
        self._streams[rid] = stream
        self._wake.set()
        try:
            if body.get("stream"):
                return await self._stream_response(request, stream, chat)
            return await self._full_response(stream, chat)
        finally:
            self._streams.pop(rid, None)
            if req.finished_at is None:
                # The client went away (or the engine died): free its KV like vLLM's abort.
                self.model.abort(req)
                self._success.labels(self.options.model, self.options.engine_label, "abort").inc()

    async def _full_response(self, stream: _Stream, chat: bool) -> web.Response:
        while True:
            item = await stream.queue.get()
            if item is None:
                break
        if stream.req.finished_at is None:
            return web.Response(status=500, text=CRASH_BODY, content_type="application/json")
        text = " tok" * stream.req.output
        usage = {"prompt_tokens": stream.req.prompt, "completion_tokens": stream.req.output,
                 "total_tokens": stream.req.prompt + stream.req.output}
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"} if chat
                  else {"index": 0, "text": text, "finish_reason": "length"})
        return web.json_response({"id": f"cmpl-{stream.req.rid}", "object": "chat.completion" if chat else "text_completion",
                                  "model": self.options.model, "choices": [choice], "usage": usage})

    async def _stream_response(self, request: web.Request, stream: _Stream, chat: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"
        try:
            while True:
                item = await stream.queue.get()
                if item is None:
                    break
                for _ in range(item):
                    piece = ({"index": 0, "delta": {"content": " tok"}, "finish_reason": None} if chat
                             else {"index": 0, "text": " tok", "finish_reason": None})
                    chunk = {"id": f"cmpl-{stream.req.rid}", "object": obj, "model": self.options.model, "choices": [piece]}
                    await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if stream.req.finished_at is None:
                err = {"error": {"message": "engine core died", "type": "internal_error", "code": 500}}
                await resp.write(f"data: {json.dumps(err)}\n\n".encode())
            else:
                # The last chunk carries finish_reason and usage, as OpenAI-compatible servers send it.
                last = ({"index": 0, "delta": {}, "finish_reason": "length"} if chat
                        else {"index": 0, "text": "", "finish_reason": "length"})
                usage = {"prompt_tokens": stream.req.prompt, "completion_tokens": stream.req.output,
                         "total_tokens": stream.req.prompt + stream.req.output}
                chunk = {"id": f"cmpl-{stream.req.rid}", "object": obj, "model": self.options.model,
                         "choices": [last], "usage": usage}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionError:
            # The client went away mid-stream; the caller aborts the request (vLLM does the same).
            pass
        return resp

    # ------------------------------------------------------------ the engine
    async def _engine_loop(self) -> None:
        model = self.model
        while True:
            started = self.now()
            duration = model.plan_step(started)
            if duration is None:
                self._wake.clear()
                if model.down or model.idle:
                    await self._wake.wait()
                    continue
                await asyncio.sleep(0.001)
                continue
            await asyncio.sleep(duration)
            now = self.now()
            first, finished = model.commit_step(now)
            self._account_step(started, now, first, finished)

    def _account_step(self, started: float, now: float, first: list[SimRequest], finished: list[SimRequest]) -> None:
        model = self.model
        for stream in self._streams.values():
            if stream.admitted_at is None and stream.req.state != WAITING:
                # Scheduled in the step that began at ``started``: its time in WAITING ended then.
                stream.admitted_at = started
                self._queue_time.observe(max(0.0, started - stream.arrival))
        step_tokens = 0
        for req in first:
            stream = self._streams.get(req.rid)
            if stream is not None:
                self._ttft.observe(now - stream.arrival)
                self._prompt_tokens.inc(req.prompt)
                step_tokens += req.prompt
        # Deliver the tokens each decoding request produced in this step.
        for stream in self._streams.values():
            req = stream.req
            if req.state == DECODE:
                produced = req.gen + (model.decode_steps - req.doff)
            elif req.finished_at is not None:
                produced = req.output
            else:
                continue
            new = min(produced, req.output) - stream.sent
            if new > 0:
                if stream.last_at is not None:
                    gap = (now - stream.last_at) / new
                    for _ in range(new):
                        self._itl.observe(gap)
                stream.last_at = now
                stream.sent += new
                self._gen_tokens.inc(new)
                step_tokens += new
                stream.queue.put_nowait(new)
        self._iteration_tokens.observe(step_tokens)
        for req in finished:
            stream = self._streams.get(req.rid)
            if stream is None:
                continue
            self._e2e.observe(now - stream.arrival)
            self._success.labels(self.options.model, self.options.engine_label, "length").inc()
            stream.queue.put_nowait(None)
        for req in model.take_failed():
            stream = self._streams.get(req.rid)
            if stream is not None:
                stream.queue.put_nowait(None)
        if model.preemptions_total > self._preemptions_seen:
            self._preemptions.inc(model.preemptions_total - self._preemptions_seen)
            self._preemptions_seen = model.preemptions_total

    async def _fault_loop(self) -> None:
        schedule = self.options.faults
        for t in schedule.transitions():
            delay = t - self.now()
            if delay > 0:
                await asyncio.sleep(delay)
            was_down = self.model.down
            lost = schedule.apply(self.model, self.now())
            for req in lost:
                stream = self._streams.get(req.rid)
                if stream is not None:
                    stream.queue.put_nowait(None)
            if self.model.down and not was_down:
                log.warning("fake engine %s: crash (closing port %d)", self.options.model, self.port)
                await self._die()
            elif was_down and not self.model.down:
                log.warning("fake engine %s: restart", self.options.model)
                self._build_metrics()
                await self._listen()
            self._wake.set()


def _error(status: int, kind: str, message: str) -> web.Response:
    return web.json_response({"object": "error", "type": kind, "code": status, "message": message}, status=status)


def _token_counts(body: dict) -> tuple[int, int]:  # type: ignore[type-arg]
    """(prompt tokens, output tokens) of an OpenAI request body."""
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens", 16))
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError("max_tokens must be a positive integer")
    explicit = body.get("prompt_tokens")
    if explicit is not None:
        if not isinstance(explicit, int) or isinstance(explicit, bool) or explicit < 1:
            raise ValueError("prompt_tokens must be a positive integer")
        return explicit, max_tokens
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list):
            raise ValueError("messages must be a list")
        text = "".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
    else:
        prompt = body.get("prompt", "")
        text = prompt if isinstance(prompt, str) else " ".join(map(str, prompt)) if isinstance(prompt, list) else ""
    return max(1, math.ceil(len(text) / 4)), max_tokens

"""``llmdiag gateway``: an OpenAI-compatible reverse proxy that routes with the balancer (SPEC 6.5).

Request path (``POST /v1/chat/completions``, ``POST /v1/completions``), written
for added TTFT (docs/benchmarks.md, "Gateway"):

1. :mod:`llmdiag.gateway.server` hands over the complete request from its
   ``data_received``; :meth:`Gateway._completions` parses only what routing
   needs (model, stream, prompt-token estimate: :mod:`llmdiag.gateway.request`),
   picks with ``balancer.pick(model, est_prompt_tokens)`` and, when a pooled
   connection to the pick is idle, sends the client's bytes upstream in that
   same event-loop turn (:mod:`llmdiag.gateway.upstream`); maybe a mirrored
   copy (:mod:`llmdiag.gateway.mirror`);
2. the rest runs as the request's task: a non-200 answer or a failure before
   the response head is classified by ``balancer.on_finish`` and retried on
   another backend when SPEC 6.3 allows it (at most ``max_retries``, backoff
   with jitter, never the same backend, only before the first byte reached
   the client); otherwise it is passed through unchanged;
3. a 200 is relayed to the client piece by piece from the upstream
   connection's ``data_received`` (no buffering, no task wake-up per chunk);
   the first body piece of a streamed answer is the first token:
   ``on_first_token(backend, ttft)`` runs after it was written; the end is
   ``on_finish(backend, ...)``. Metrics and the access log run after the send
   or after the last byte, never before the first token.

Every pick ends with exactly one ``on_finish``: a client that hangs up is
reported with status 499 (the client's doing, not counted against the
backend), after the upstream request has been cancelled by closing its
connection (HTTP/1.1 has no other cancel; vLLM aborts the request when its
client goes away).

Timeouts: ``connect_timeout_seconds`` to connect; ``idle_timeout_seconds`` of
silence between reads (headers included); ``request_timeout_seconds`` for
the whole exchange. Connections: one pool, at most
``max_connections_per_backend`` per backend, kept alive for reuse, so the
gateway does not open (and TIME_WAIT) a connection per request; the only
connections it closes early are those of cancelled or failed requests.

Background tasks (on an aiohttp session): node agents' penalties
(:mod:`llmdiag.router_feedback.agent_penalties`), the engines' own metrics
(:mod:`llmdiag.gateway.engine_signals`), active probes (what re-admits an
ejected backend) and the backends' model lists (backends configured without
``models`` learn them from ``/v1/models``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from llmdiag.config.engine import EngineConfig
from llmdiag.config.gateway import GatewayConfig, split_listen
from llmdiag.model import Backend
from llmdiag.router_feedback.agent_penalties import AgentPenalties
from llmdiag.router_feedback.balancer import Balancer, NoBackendAvailable
from llmdiag.router_feedback.errors import CONNECT_ERROR, TIMEOUT, Classification, ResponseClass
from llmdiag.router_feedback.probes import AiohttpProbeClient, ProbeRunner
from llmdiag.router_feedback.retry import RetryPolicy

from llmdiag.gateway.engine_signals import EngineSignals
from llmdiag.gateway.metrics import GatewayMetrics
from llmdiag.gateway.mirror import Mirror
from llmdiag.gateway.request import BadRequest, RoutedRequest, forward_headers, forward_raw_headers, parse_request
from llmdiag.gateway.server import Exchange, HttpServer
from llmdiag.gateway.upstream import (ConnectFailed, UpstreamConnection, UpstreamError, UpstreamPool,
                                      UpstreamTimeout)

__all__ = ["BACKEND_HEADER", "CLIENT_CLOSED", "Gateway", "access_logger"]

log = logging.getLogger(__name__)

#: Response header naming the backend that answered.
BACKEND_HEADER = "x-llmdiag-backend"
#: Response header with the routing decision (score and load at pick time, attempts).
ROUTE_HEADER = "x-llmdiag-route"
#: Status reported to the balancer when the client went away (nginx's convention; a 4xx is not the backend's fault).
CLIENT_CLOSED = 499
#: Error bodies are read up to this size (classification reads a prefix; the client gets what was read).
_MAX_ERROR_BODY = 256 * 1024
_MAX_MODELS_BODY = 1 << 20
#: Client-side write buffer above which reading from the backend pauses, and below which it resumes.
_HIGH_WATER = 1 << 20
_LOW_WATER = 256 * 1024
#: What ``on_finish`` hears when the gateway itself failed a request (a bug): 499's class, not held against
#: the backend; reporting it at all keeps the balancer's in-flight count true (every pick, one on_finish).
_GATEWAY_FAULT = CLIENT_CLOSED


@dataclass(slots=True)
class _Failure:
    """An attempt that produced no 200: what the client gets if it is not retried."""

    backend: Backend
    status: int | str
    classification: Classification
    body: bytes = b""
    headers: Sequence[tuple[str, str]] = ()


def access_logger(where: str) -> logging.Logger | None:
    """The access log: ``-`` = stderr, ``""`` = none, else a file appended to."""
    if not where:
        return None
    logger = logging.getLogger("llmdiag.gateway.access")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    handler: logging.Handler = logging.StreamHandler(sys.stderr) if where == "-" else logging.FileHandler(where)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    logger.addHandler(handler)
    return logger


class Gateway:
    """The proxy: an aiohttp application plus its background tasks.

    ``start()`` binds ``config.listen`` (port 0 picks one: :attr:`port`),
    ``stop()`` undoes everything. The balancer is the caller's (it may hold
    backends with state already); its clock should be monotonic seconds.
    """

    def __init__(self, config: GatewayConfig, balancer: Balancer, *, rng: Any = None,
                 access_log: logging.Logger | None = None, engine_config: EngineConfig | None = None) -> None:
        self.config = config
        self.balancer = balancer
        self._rng = rng if rng is not None else random.Random()
        self._retry = RetryPolicy(balancer.config, self._rng)
        self._access = access_log
        self.agents = (AgentPenalties(config.agents, token=config.agent_token or None, interval=config.agent_poll_seconds,
                                      timeout=config.agent_timeout_seconds) if config.agents else None)
        self.engine_signals = (EngineSignals(balancer, engine_config, config.engine_signals_seconds)
                               if config.engine_signals else None)
        self.metrics = GatewayMetrics(balancer, self.agents, extra=self._extra_counters)
        self._session: aiohttp.ClientSession | None = None
        self._pool: UpstreamPool | None = None
        self._targets: dict[str, tuple[bytes, bytes]] = {}  # backend URL -> (Host header line, path prefix)
        self._server: HttpServer | None = None
        self._routes = {"/v1/chat/completions": ("POST", self._completions), "/v1/completions": ("POST", self._completions),
                        "/v1/models": ("GET", self._models), "/metrics": ("GET", self._metrics),
                        "/healthz": ("GET", self._healthz)}
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._probes: ProbeRunner | None = None
        self.mirror: Mirror | None = None
        self._fixed_models = {b.name for b in balancer.backends if b.models}
        self._models_cache: tuple[float, list[dict[str, Any]]] = (-1e18, [])
        self._models_lock = asyncio.Lock()
        self.host, self.port = split_listen(config.listen)

    # --------------------------------------------------------------- lifecycle

    def dispatch(self, exchange: Exchange) -> Any:
        """The coroutine answering one client request (:class:`~llmdiag.gateway.server.Handler`)."""
        route = self._routes.get(exchange.path)
        if route is None:
            return self._local(exchange, _error(404, f"no route for {exchange.path}", "not_found"))
        method, handler = route
        if exchange.method != method:
            return self._local(exchange, _error(405, f"{exchange.path} takes {method}", "method_not_allowed"))
        return handler(exchange)

    async def start(self) -> None:
        cfg = self.config
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=cfg.max_connections_per_backend,
                                         keepalive_timeout=cfg.upstream_keepalive_seconds, ttl_dns_cache=300)
        self._timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_seconds, sock_connect=cfg.connect_timeout_seconds,
                                              sock_read=cfg.idle_timeout_seconds)
        # auto_decompress off: compressed answers pass through as the backend sent them.
        # No automatic Accept/Accept-Encoding/User-Agent: upstream sees the client's own headers.
        self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False, timeout=self._timeout,
                                              skip_auto_headers=("Accept", "Accept-Encoding", "User-Agent"))
        # The request path's own client (llmdiag.gateway.upstream); the aiohttp session above serves
        # everything off that path: probes, /v1/models, agents, the mirror.
        self._pool = UpstreamPool(limit_per_backend=cfg.max_connections_per_backend, keepalive_seconds=cfg.upstream_keepalive_seconds,
                                  connect_timeout=cfg.connect_timeout_seconds)
        if cfg.mirror_url:
            self.mirror = Mirror(cfg.mirror_url, cfg.mirror_fraction, cfg.mirror_max_in_flight, self._session,
                                 cfg.request_timeout_seconds, self._rng, self.metrics.mirrored)
        # A client that hangs up cancels its request's task at once (llmdiag.gateway.server), so the
        # upstream request is cancelled even while the engine has not answered anything yet.
        self._server = HttpServer(self, max_body_bytes=cfg.max_request_bytes, keepalive_seconds=cfg.keepalive_seconds,
                                  head_timeout_seconds=cfg.head_timeout_seconds,
                                  body_timeout_seconds=cfg.body_timeout_seconds, max_connections=cfg.max_client_connections,
                                  linger_seconds=cfg.linger_seconds)
        await self._server.start(self.host, self.port)
        self.port = self._server.port
        self._stop.clear()
        if self.agents is not None:
            self._tasks.append(asyncio.create_task(self.agents.run(self._session, self.balancer, self._stop)))
        if self.engine_signals is not None:
            self._tasks.append(asyncio.create_task(self.engine_signals.run(self._stop)))
        if cfg.probes:
            self._probes = ProbeRunner(self.balancer, AiohttpProbeClient(self.balancer.config.probe_prompt, session=self._session))
            self._probes.start()
        self._tasks.append(asyncio.create_task(self._models_loop()))

    async def stop(self) -> None:
        self._stop.set()
        if self._probes is not None:
            await self._probes.close()
            self._probes = None
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        if self.mirror is not None:
            await self.mirror.close()
        if self._server is not None:
            await self._server.stop(grace=1.0)
            self._server = None
        if self._pool is not None:
            await self._pool.close()
            self._pool = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _extra_counters(self) -> dict[str, float]:
        probes = self._probes
        return {"engine_signal_rounds": self.engine_signals.rounds_total if self.engine_signals else 0,"probes": probes.probes_total if probes else 0, "probe_failures": probes.probe_failures_total if probes else 0}

    # ---------------------------------------------------------------- handlers

    async def _local(self, exchange: Exchange, answer: _Answer) -> None:
        exchange.respond(answer.status, answer.body)

    async def _healthz(self, exchange: Exchange) -> None:
        exchange.respond(200, b"ok\n", content_type="text/plain; charset=utf-8")

    async def _metrics(self, exchange: Exchange) -> None:
        exchange.respond(200, generate_latest(self.metrics.registry), content_type=CONTENT_TYPE_LATEST)

    def _completions(self, exchange: Exchange) -> Any:
        """Runs in the server's ``data_received``: parse, pick, and send upstream at once when a pooled
        connection to the pick is idle (the common case), so the request leaves in the same event-loop
        turn that read it; then the coroutine that waits for the answer (run as the request's task)."""
        cfg = self.config
        started = time.perf_counter()
        raw = exchange.body
        try:
            routed = parse_request(raw, cfg.chars_per_token)
        except BadRequest as exc:
            return self._local_logged(exchange, started, _error(400, str(exc)))
        headers = forward_raw_headers(exchange.headers)
        first: tuple[Backend, float, UpstreamConnection | None, float] | None = None
        t0 = time.perf_counter()
        with contextlib.suppress(NoBackendAvailable):  # the coroutine picks again and answers it
            backend = self.balancer.pick(routed.model, routed.est_prompt_tokens, exclude=())
            decision = time.perf_counter() - t0
            conn = self._pool.try_acquire(backend.url) if self._pool is not None else None
            sent_at = time.perf_counter()
            if conn is not None:
                try:
                    conn.send(self._request_bytes(backend, exchange.path, exchange.query, headers, raw),
                              cfg.idle_timeout_seconds, asyncio.get_running_loop().time() + cfg.request_timeout_seconds)
                except UpstreamError:  # closed under our feet: the coroutine acquires another one
                    conn.close()
                    conn = None
                except Exception:
                    conn.close()  # a bug here: the pick still gets its on_finish, then the server answers 500
                    self._end(backend, _GATEWAY_FAULT, routed.est_prompt_tokens, False)
                    raise
            first = (backend, decision, conn, sent_at)
        if self.mirror is not None:
            self.mirror.maybe(exchange.path, raw, forward_headers((k.decode("latin-1"), v.decode("latin-1"))
                                                                  for k, v in exchange.headers))
        self.metrics.in_flight.inc()
        return self._complete(exchange, routed, headers, started, first)

    async def _local_logged(self, exchange: Exchange, started: float, answer: _Answer) -> None:
        self._finish_local(exchange, started, answer)

    async def _complete(self, exchange: Exchange, routed: RoutedRequest, headers: bytes, started: float,
                        first: tuple[Backend, float, UpstreamConnection | None, float] | None) -> None:
        """Attempts (the first one maybe already sent), retries before the first byte, the answer."""
        raw = exchange.body
        tried: list[str] = []
        failure: _Failure | None = None
        reason = "pick"
        metrics = self.metrics
        try:
            while True:
                t0 = time.perf_counter()
                try:
                    if first is not None:
                        backend, decision, conn, sent_at = first
                        first = None
                    else:
                        backend = self.balancer.pick(routed.model, routed.est_prompt_tokens, exclude=tried)
                        decision, conn, sent_at = time.perf_counter() - t0, None, 0.0
                except NoBackendAvailable as exc:
                    metrics.no_backend.inc()
                    if failure is not None:  # retries ran out of backends: the client gets the last answer
                        return await self._pass_failure(exchange, failure, started, len(tried), f"{reason}; {exc}")
                    if routed.model is not None and not self._anyone_serves(routed.model):
                        return self._finish_local(exchange, started, _error(
                            404, f"The model `{routed.model}` does not exist.", "model_not_found"), routed.model)
                    return self._finish_local(exchange, started, _error(503, str(exc), "no_backend_available"), routed.model)
                tried.append(backend.name)
                result = await self._attempt(exchange, backend, routed.stream, routed.est_prompt_tokens, raw, headers,
                                             len(tried), reason, started, routed.model, decision, conn, sent_at)
                if not isinstance(result, _Failure):
                    return None
                failure = result
                why = self._retry.decide(len(tried), result.classification, result.status, first_byte_sent=False)
                if not why.retry:
                    return await self._pass_failure(exchange, failure, started, len(tried), f"{reason}; not retried: {why.why}")
                cls = result.classification.response_class.value
                metrics.child(metrics.retries, cls).inc()
                reason = f"retry after {cls} from {backend.name}"
                if why.delay_seconds > 0:
                    await asyncio.sleep(why.delay_seconds)
        finally:
            metrics.in_flight.dec()

    def _anyone_serves(self, model: str) -> bool:
        """Whether any backend (eligible or not) serves ``model``; backends without a model list serve anything."""
        return any(not b.models or model in b.models for b in self.balancer.backends)

    def _request_bytes(self, backend: Backend, path: str, query: str, headers: bytes, raw: bytes) -> bytes:
        """The upstream request, head and body in one piece (one write, one segment on the wire)."""
        target = self._targets.get(backend.url)
        if target is None:
            parts = urlsplit(backend.url)
            host = parts.hostname or ""
            host = f"[{host}]" if ":" in host else host
            default = 443 if parts.scheme == "https" else 80
            netloc = host if parts.port in (None, default) else f"{host}:{parts.port}"
            target = self._targets[backend.url] = (f"Host: {netloc}\r\n".encode(), parts.path.rstrip("/").encode())
        host_line, prefix = target
        target = f"{path}?{query}" if query else path
        return b"".join((b"POST ", prefix, target.encode("utf-8", "surrogateescape"), b" HTTP/1.1\r\n", host_line, headers,
                         b"Content-Length: %d\r\n\r\n" % len(raw), raw))

    async def _attempt(self, exchange: Exchange, backend: Backend, stream: bool, est: int, raw: bytes,
                       headers: bytes, attempt: int, reason: str, started: float, model: str | None,
                       decision: float, conn: UpstreamConnection | None = None, sent_at: float = 0.0) -> _Failure | None:
        """One upstream exchange; a :class:`_Failure` when nothing reached the client (retry candidate).

        ``conn``: the request was already sent on it, at ``sent_at`` (see :meth:`_completions`).

        Order matters for TTFT: the request goes upstream first, and the
        bookkeeping (metrics, the route header) runs while the backend works.
        """
        balancer = self.balancer
        pool = self._pool
        assert pool is not None
        cfg = self.config
        relay: _Relay | None = None
        finished = False
        route = ""
        try:
            try:
                if conn is None:
                    conn = await pool.acquire(backend.url)
                    sent_at = time.perf_counter()
                    conn.send(self._request_bytes(backend, exchange.path, exchange.query, headers, raw),
                              cfg.idle_timeout_seconds, asyncio.get_running_loop().time() + cfg.request_timeout_seconds)
                metrics = self.metrics
                metrics.child(metrics.decision, backend.name).observe(decision)
                metrics.child(metrics.picks, backend.name).inc()
                route = f"score={balancer.score(backend):.1f}; load={balancer.load(backend):.1f}; attempt={attempt}"
                head = await conn.read_head()
            except UpstreamTimeout:
                return self._failed(backend, TIMEOUT, est)
            except ConnectFailed as exc:
                # Refused, reset, or a pooled connection the backend had closed: nothing was processed.
                log.debug("%s: %s", backend.name, exc)
                return self._failed(backend, CONNECT_ERROR, est)
            except UpstreamError as exc:
                log.debug("%s: %s", backend.name, exc)
                return self._failed(backend, 502, est)
            if head.status != 200:
                try:
                    body = await conn.read_body(_MAX_ERROR_BODY)
                except UpstreamError:
                    body = b""
                failure = self._failed(backend, head.status, est, body, head.header_map())
                failure.body, failure.headers = body, forward_headers(head.headers)
                finished = True
                return failure
            out_headers = forward_headers(head.headers)
            out_headers.append((BACKEND_HEADER, backend.name))
            out_headers.append((ROUTE_HEADER, route))
            exchange.start(200, out_headers, head.content_length)
            relay = _Relay(exchange, conn, self._first_token_hook(backend, est, sent_at) if stream else None)
            conn.stream_body(relay)
            while True:
                try:
                    ended = await conn.wait_body()
                except UpstreamTimeout:
                    self._end(backend, TIMEOUT, est, relay.first_at is not None)
                    finished = True
                    exchange.abort()
                    self._log(exchange, model, 200, backend, attempt, reason + "; upstream went silent", route, started,
                              relay.first_at, relay.size, "timeout")
                    return None
                except UpstreamError as exc:
                    if relay.client_gone:
                        break
                    log.info("%s: stream broke after %d bytes: %s", backend.name, relay.size, exc)
                    self._end(backend, 502, est, relay.first_at is not None)
                    finished = True
                    exchange.abort()
                    self._log(exchange, model, 200, backend, attempt, reason + "; upstream broke mid-stream", route, started,
                              relay.first_at, relay.size, "server_5xx")
                    return None
                if ended or relay.client_gone:
                    break
                # Paused: the client reads slower than the backend writes; resume once its buffer drained.
                # The exchange's deadline still runs meanwhile (a client that never reads must not hold the
                # backend's connection and this task forever): a failed connection ends the wait.
                while ((transport := exchange.transport) is not None and not conn.failed
                       and transport.get_write_buffer_size() > _LOW_WATER):
                    await asyncio.sleep(0.005)
                conn.resume()
            if relay.client_gone:
                conn.close()
                self._client_gone(backend, est, stream and relay.first_at is not None)
                finished = True
                self._log(exchange, model, CLIENT_CLOSED, backend, attempt, reason + "; client went away", route, started,
                          relay.first_at, relay.size, "client_closed")
                return None
            self._end(backend, 200, est, stream and relay.first_at is not None)
            finished = True
            exchange.end()
            self._log(exchange, model, 200, backend, attempt, reason, route, started, relay.first_at, relay.size, "ok")
            return None
        except asyncio.CancelledError:
            # The client hung up (the server cancelled this task): cancel upstream, then tell the balancer.
            if conn is not None:
                conn.close()
            if not finished:
                first_at = relay.first_at if relay is not None else None
                self._client_gone(backend, est, stream and first_at is not None)
                finished = True
                self._log(exchange, model, CLIENT_CLOSED, backend, attempt, reason + "; client went away", route, started,
                          first_at, relay.size if relay is not None else 0, "client_closed")
            raise
        except Exception:
            # A bug on this path (the server logs it and answers 500 or aborts): the pick still ends once.
            if not finished:
                self._end(backend, _GATEWAY_FAULT, est, stream and relay is not None and relay.first_at is not None)
                finished = True
            if conn is not None:
                conn.close()
            raise
        finally:
            if conn is not None:
                if finished:
                    pool.release(conn)  # reused only if its answer was read to the end
                else:
                    conn.close()

    def _first_token_hook(self, backend: Backend, est: int, sent_at: float) -> Any:
        """What the first streamed chunk triggers, after it was written to the client: TTFT to the balancer."""
        balancer = self.balancer
        histogram = self.metrics.child(self.metrics.ttft, backend.name)

        def on_first(first_at: float) -> None:
            ttft = first_at - sent_at
            balancer.on_first_token(backend, ttft, est)
            histogram.observe(ttft)

        return on_first

    # ----------------------------------------------------------------- feedback

    def _failed(self, backend: Backend, status: int | str, est: int, body: bytes | None = None,
                headers: Any = None) -> _Failure:
        cls = self._end(backend, status, est, False, body, headers)
        return _Failure(backend, status, cls)

    def _end(self, backend: Backend, status: int | str, est: int, first_token_seen: bool, body: bytes | None = None,
             headers: Any = None) -> Classification:
        cls = self.balancer.on_finish(backend, status, body, headers, first_token_seen=first_token_seen, prompt_tokens=est)
        self.metrics.child(self.metrics.responses, backend.name, cls.response_class.value).inc()
        return cls

    def _client_gone(self, backend: Backend, est: int, first_token_seen: bool) -> None:
        self.metrics.client_disconnects.inc()
        self._end(backend, CLIENT_CLOSED, est, first_token_seen)

    # ----------------------------------------------------------------- answers

    async def _pass_failure(self, exchange: Exchange, failure: _Failure, started: float, attempts: int,
                            reason: str) -> None:
        status = failure.status if isinstance(failure.status, int) else (504 if failure.status == TIMEOUT else 502)
        extra = [(BACKEND_HEADER, failure.backend.name), (ROUTE_HEADER, f"attempt={attempts}")]
        if failure.body:  # the backend's own answer, as it sent it
            exchange.start(status, [*failure.headers, *extra], len(failure.body))
            exchange.write([failure.body])
            exchange.end()
        else:
            what = {TIMEOUT: "timed out", CONNECT_ERROR: "could not be reached"}.get(
                failure.status if isinstance(failure.status, str) else "", f"answered {status} without a body")
            answer = _error(status, f"backend {failure.backend.name} {what}", "upstream_error")
            exchange.respond(answer.status, answer.body, extra)
        cls = failure.classification.response_class.value
        self._log(exchange, None, status, failure.backend, attempts, reason, f"class={cls}", started, None, len(failure.body), cls)

    def _finish_local(self, exchange: Exchange, started: float, answer: _Answer, model: str | None = None) -> None:
        exchange.respond(answer.status, answer.body)
        self._log(exchange, model, answer.status, None, 0, "answered by the gateway", "", started, None, 0,
                  f"gateway_{answer.status}")

    def _log(self, exchange: Exchange, model: str | None, status: int, backend: Backend | None, attempts: int, reason: str,
             route: str, started: float, first_at: float | None, size: int, outcome: str) -> None:
        """One access-log line and the ``requests{endpoint, class}`` count (``outcome`` is the class).

        Runs after the answer's last byte (or its failure): never before the first token.
        """
        self.metrics.child(self.metrics.requests, exchange.path, outcome).inc()
        if self._access is None:
            return
        now = time.perf_counter()
        ttft = f"{(first_at - started) * 1000:.1f}" if first_at is not None else "-"
        self._access.info('%s "%s %s" %s model=%s backend=%s %s reason="%s" ttft_ms=%s duration_ms=%.1f bytes=%d',
                          exchange.remote, exchange.method, exchange.path, status, model or "-",
                          backend.name if backend else "-", route or "-", reason, ttft, (now - started) * 1000, size)

    # ------------------------------------------------------------------ models

    async def _models(self, exchange: Exchange) -> None:
        data = await self.models()
        exchange.respond(200, json.dumps({"object": "list", "data": data}).encode())

    async def models(self, max_age: float | None = None) -> list[dict[str, Any]]:
        """``/v1/models`` of every backend, merged by id (first answer wins), cached ``models_cache_seconds``."""
        max_age = self.config.models_cache_seconds if max_age is None else max_age
        async with self._models_lock:
            at, data = self._models_cache
            if time.monotonic() - at <= max_age:
                return data
            backends = self.balancer.backends
            answers = await asyncio.gather(*(self._backend_models(b) for b in backends))
            merged: dict[str, dict[str, Any]] = {}
            learned: dict[str, tuple[str, ...]] = {}
            for backend, models in zip(backends, answers):
                if models is None:
                    continue
                for m in models:
                    merged.setdefault(m["id"], m)
                learned[backend.name] = tuple(m["id"] for m in models)
            self._learn_models(learned)
            data = list(merged.values())
            self._models_cache = (time.monotonic(), data)
            return data

    async def _backend_models(self, backend: Backend) -> list[dict[str, Any]] | None:
        assert self._session is not None
        try:
            timeout = aiohttp.ClientTimeout(total=min(5.0, self.config.request_timeout_seconds))
            async with self._session.get(f"{backend.url}/v1/models", headers={"Accept": "application/json"},
                                         timeout=timeout) as resp:
                if resp.status != 200:
                    return None
                doc = await resp.json(content_type=None)
        except (asyncio.TimeoutError, aiohttp.ClientError, ValueError) as exc:
            log.debug("models of %s: %s", backend.name, exc)
            return None
        items = doc.get("data") if isinstance(doc, dict) else None
        if not isinstance(items, list):
            return None
        return [m for m in items if isinstance(m, dict) and isinstance(m.get("id"), str)]

    def _learn_models(self, learned: dict[str, tuple[str, ...]]) -> None:
        """Backends configured without models route by what their ``/v1/models`` says."""
        changed = False
        backends = []
        for b in self.balancer.backends:
            models = learned.get(b.name)
            if b.name not in self._fixed_models and models and models != b.models:
                b = replace(b, models=models)
                changed = True
            backends.append(b)
        if changed:
            self.balancer.set_backends(backends)

    async def _models_loop(self) -> None:
        while not self._stop.is_set():
            try:
                await self.models(max_age=0.0)
            except Exception:  # noqa: BLE001 - model discovery is best effort; routing goes on without it
                log.exception("refreshing backend models failed")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), 30.0)


class _Relay:
    """Writes a 200's body to the client as it arrives: called from the backend connection's ``data_received``.

    Writing in the same event-loop turn that read the bytes is what keeps the
    gateway's added time to first token small (no task wake-up per chunk). A
    client gone closes the upstream connection (the cancel); a client buffer
    over the high-water mark pauses reading from the backend (the handler
    resumes it once the client drained).
    """

    __slots__ = ("client_gone", "conn", "exchange", "first_at", "on_first", "size")

    def __init__(self, exchange: Exchange, conn: UpstreamConnection, on_first: Any) -> None:
        self.exchange = exchange
        self.conn = conn
        self.on_first = on_first
        self.first_at: float | None = None
        self.size = 0
        self.client_gone = False

    def __call__(self, pieces: list[bytes]) -> None:
        first = self.first_at is None
        if first:
            self.first_at = time.perf_counter()
        buffered = self.exchange.write(pieces)
        if buffered < 0:
            self.client_gone = True
            self.conn.close()  # the cancel: the engine aborts a request whose connection went away
            return
        for piece in pieces:
            self.size += len(piece)
        if first and self.on_first is not None:
            try:
                self.on_first(self.first_at)
            except Exception:  # noqa: BLE001 - bookkeeping must not break the stream
                log.exception("first-token bookkeeping failed")
        if buffered > _HIGH_WATER:
            self.conn.pause()


@dataclass(frozen=True, slots=True)
class _Answer:
    status: int
    body: bytes


def _error(status: int, message: str, kind: str = "invalid_request_error") -> _Answer:
    return _Answer(status, json.dumps({"object": "error", "type": kind, "code": status, "message": message}).encode())

"""The ext_proc servicer: one gRPC stream per HTTP request, picked with the balancer.

Message flow for one request (Envoy ``processing_mode``: request headers
SEND, request body BUFFERED, response headers SEND, response body STREAMED,
trailers SKIP; ``allow_mode_override: true``)::

    request_headers  -> continue; or pick now when the request has no body, or when the gateway
                        put the model in a header (``model_header``): then the body is skipped
    request_body     -> parse model and prompt, pick: destination header + envoy.lb metadata,
                        or an immediate 400 / 404 / 413 / 503 JSON answer
    response_headers -> note the status; a 2xx that is not a stream is finished here and the
                        rest of its body is not sent to the picker (mode override)
    response_body    -> the first chunk of a 2xx stream is the first token (TTFT);
                        an error body is kept (bounded) to classify it; end_of_stream finishes

Exactly once: a picked request's ``on_finish`` runs once, whatever ends the
stream (end of the response, a clean close, a reset, the client going away,
an upstream that refused): the stream's ``finally`` finishes whatever is
still open. A request the response never completed is reported with status
499 (client closed), which the balancer does not count against the backend;
Envoy's own 503 "upstream connect error ... connection failure" and 504
"upstream request timeout" are reported as ``connect_error`` and
``timeout``. Per-request state lives in the stream's coroutine and is
bounded: the body is capped at ``max_body_bytes``, an error body at
``error_body_bytes``, and the server caps concurrent streams.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from grpc.aio import EOF

from llmdiag.config.picker import PickerConfig
from llmdiag.model import Backend
from llmdiag.picker import protocol
from llmdiag.picker.metrics import PickerMetrics
from llmdiag.picker.request import BadRequest, RequestInfo, parse_request_body
from llmdiag.router_feedback.balancer import Balancer, NoBackendAvailable
from llmdiag.router_feedback.errors import CONNECT_ERROR, TIMEOUT

__all__ = ["CLIENT_CLOSED", "EndpointPickerService"]

log = logging.getLogger("llmdiag.picker")

#: Status reported for a request whose response never completed (nginx's "client closed request").
CLIENT_CLOSED = 499


class EndpointPickerService:
    """Routes each ext_proc stream's request with ``balancer`` and feeds its outcome back."""

    def __init__(self, balancer: Balancer, config: PickerConfig | None = None, metrics: PickerMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.balancer = balancer
        self.config = config or PickerConfig()
        self.metrics = metrics or PickerMetrics()
        self.clock = clock
        self.replies = protocol.ReplyCache()
        self.in_flight: dict[str, int] = {}
        self._by_address: dict[str, Backend] = {}
        self._models: frozenset[str] = frozenset()
        self._wildcard = False
        self._index(balancer.backends)
        self.metrics.watch_backends(self._backend_rows)

    # ------------------------------------------------------------ backends

    def set_backends(self, backends: Iterable[Backend]) -> None:
        backends = list(backends)
        self.balancer.set_backends(backends)
        self._index(backends)

    def _index(self, backends: Iterable[Backend]) -> None:
        backends = list(backends)
        self._by_address = {b.address: b for b in backends}
        self._models = frozenset(m for b in backends for m in b.models)
        self._wildcard = any(not b.models for b in backends)
        self.replies.retain(self._by_address)
        names = {b.name for b in backends}
        # Forget backends that left and have nothing in flight (DNS discovery churns pod addresses).
        for name in [n for n, count in self.in_flight.items() if n not in names and count <= 0]:
            del self.in_flight[name]
        for name in names:
            self.in_flight.setdefault(name, 0)

    def _backend_rows(self) -> Iterable[tuple[str, int, float, float]]:
        balancer = self.balancer
        for b in balancer.backends:
            yield b.name, self.in_flight.get(b.name, 0), balancer.load(b), balancer.score(b)

    def serves(self, model: str | None) -> bool:
        """Whether any backend declares ``model`` (or declares no models, serving any)."""
        return model is None or self._wildcard or model in self._models

    # ------------------------------------------------------------- streams

    async def process(self, requests: Any, context: Any) -> None:
        """The ``Process`` RPC, on grpc.aio's ``context.read()``/``context.write()`` (cheaper than an async
        generator per message). Replies are serialised ``ProcessingResponse`` bytes (identity serializer).

        Bookkeeping that the reply does not depend on (feedback to the balancer, metrics) runs after the
        reply is written, so it is off the request's path.
        """
        exchange = _Exchange(self)
        metrics = self.metrics
        metrics.streams_active.inc()
        read, write = context.read, context.write
        try:
            while True:
                request = await read()
                if request is EOF:
                    break
                reply = exchange.handle(request)
                if reply is not None:
                    await write(reply)
                if exchange.deferred:
                    try:
                        exchange.run_deferred()
                    except Exception:  # noqa: BLE001 - the reply went out; never fail the request for bookkeeping
                        metrics.failures["internal"].inc()
                        log.exception("picker bookkeeping failed")
        finally:
            metrics.streams_active.dec()
            try:
                exchange.close()
            except Exception:  # noqa: BLE001 - a bug in bookkeeping must not hide how the stream ended
                metrics.failures["internal"].inc()
                log.exception("picker bookkeeping failed at the end of a stream")


class _Exchange:
    """One request's state, from its headers to the end of its response."""

    __slots__ = (
        "service", "subset", "body", "backend", "tokens", "picked_at", "status", "streaming", "first_token",
        "error_body", "headers", "finished", "last_event_at", "answered", "deferred", "finish_status", "ttft",
        "decision_seconds",
    )

    def __init__(self, service: EndpointPickerService) -> None:
        self.service = service
        self.subset: tuple[str, ...] | None = None
        self.body: bytearray | None = None
        self.backend: Backend | None = None
        self.tokens = 0
        self.picked_at = 0.0
        self.status: int | None = None
        self.streaming = False
        self.first_token = False
        self.error_body: bytearray | None = None
        self.headers: dict[str, str] | None = None
        self.finished = False
        self.answered = False  # the picker answered the client itself (no upstream request)
        self.last_event_at = 0.0
        self.deferred = False  # feedback or metrics wait for run_deferred() (after the reply is written)
        self.finish_status: int | str | None = None
        self.ttft: float | None = None
        self.decision_seconds: float | None = None

    def handle(self, request: pb.ProcessingRequest) -> bytes | None:
        kind = request.WhichOneof("request")
        if request.HasField("metadata_context"):
            hint = protocol.subset_hint(request)
            if hint is not None:
                self.subset = hint
        if kind == "request_body":
            return self._request_body(request.request_body)
        if kind == "response_body":
            return self._response_body(request.response_body)
        if kind == "request_headers":
            return self._request_headers(request.request_headers)
        if kind == "response_headers":
            return self._response_headers(request.response_headers)
        if kind == "request_trailers":
            return protocol.CONTINUE_REQUEST_TRAILERS
        if kind == "response_trailers":
            return protocol.CONTINUE_RESPONSE_TRAILERS
        self.service.metrics.failures["protocol"].inc()
        return None

    # ------------------------------------------------------------ request

    def _request_headers(self, headers: pb.HttpHeaders) -> bytes:
        if headers.end_of_stream:  # no body (GET /v1/models, /health): any backend, picked now
            return self._decide(b"", protocol.ON_HEADERS)
        service = self.service
        model_header = service.config.model_header
        if model_header:
            model = protocol.header_value(headers, model_header)
            if model:
                # Fast path: the gateway already put the model in a header (the inference gateways'
                # body-based router does): pick now, from the body's size, and skip the body message.
                length = protocol.header_value(headers, "content-length")
                size = int(length) if length and length.isdigit() else 0
                if size > service.config.max_body_bytes:
                    return self._answer(413, "body_too_large", "request_too_large",
                                        f"request body larger than {service.config.max_body_bytes} bytes")
                tokens = int(size / service.config.chars_per_token + 0.5)
                return self._pick(RequestInfo(model, tokens), protocol.ON_HEADERS_SKIP_BODY, time.perf_counter())
        return protocol.CONTINUE_REQUEST_HEADERS

    def _request_body(self, body: pb.HttpBody) -> bytes:
        service = self.service
        if self.backend is not None or self.answered:
            service.metrics.failures["protocol"].inc()  # body after the decision: not BUFFERED mode
            return protocol.CONTINUE_REQUEST_BODY
        chunk = body.body
        if body.end_of_stream and self.body is None:
            data = chunk  # the common case: the whole buffered body in one message, no copy
        else:
            if self.body is None:
                self.body = bytearray()
            self.body += chunk
            if len(self.body) > service.config.max_body_bytes:
                self.body = None
                return self._answer(413, "body_too_large", "request_too_large",
                                    f"request body larger than {service.config.max_body_bytes} bytes")
            if not body.end_of_stream:
                return protocol.CONTINUE_REQUEST_BODY
            data = bytes(self.body)
            self.body = None
        if len(data) > service.config.max_body_bytes:
            return self._answer(413, "body_too_large", "request_too_large",
                                f"request body larger than {service.config.max_body_bytes} bytes")
        return self._decide(data, protocol.ON_BODY)

    def _decide(self, data: bytes, where: int) -> bytes:
        started = time.perf_counter()
        try:
            info = parse_request_body(data, self.service.config.chars_per_token)
        except BadRequest as exc:
            return self._answer(400, "bad_request", "invalid_request_error", str(exc))
        return self._pick(info, where, started)

    def _pick(self, info: RequestInfo, where: int, started: float) -> bytes:
        service = self.service
        if not service.serves(info.model):
            return self._answer(404, "unknown_model", "model_not_found",
                                f"model {info.model!r} is not served by any backend of this pool")
        exclude: tuple[Backend, ...] | list[Backend] = ()
        if self.subset is not None:
            known = [a for a in self.subset if a in service._by_address]
            if not known:
                return self._answer(503, "subset_unknown", "no_endpoint",
                                    "none of the proxy's subset endpoints is a backend of this picker")
            allowed = set(known)
            exclude = [b for a, b in service._by_address.items() if a not in allowed]
        try:
            backend = service.balancer.pick(info.model, info.est_prompt_tokens, exclude)
        except NoBackendAvailable as exc:
            return self._answer(503, "no_backend", "no_endpoint", str(exc))
        self.backend = backend
        self.tokens = info.est_prompt_tokens
        self.picked_at = service.clock()
        service.in_flight[backend.name] = service.in_flight.get(backend.name, 0) + 1
        reply = service.replies.pick(backend.address, where)
        self.decision_seconds = time.perf_counter() - started
        self.deferred = True
        return reply

    def _answer(self, status: int, failure: str, error: str, message: str) -> bytes:
        self.answered = True
        self.service.metrics.failures[failure].inc()
        return protocol.immediate_reply(status, error, message, f"llmdiag_picker_{failure}")

    # ----------------------------------------------------------- response

    def _response_headers(self, headers: pb.HttpHeaders) -> bytes:
        if self.backend is None:
            return protocol.CONTINUE_RESPONSE_HEADERS
        self.last_event_at = self.service.clock()
        status_text = protocol.header_value(headers, ":status")
        try:
            self.status = int(status_text) if status_text else 502
        except ValueError:
            self.status = 502
        if self.status >= 400:
            # Keep the error body (bounded) and the headers: they tell saturation from a client quota.
            self.error_body = bytearray()
            self.headers = {h.key: (h.raw_value.decode("latin-1") if h.raw_value else h.value)
                            for h in headers.headers.headers if not h.key.startswith(":")}
            if headers.end_of_stream:
                self._finish(self.status)
            return protocol.CONTINUE_RESPONSE_HEADERS
        content_type = protocol.header_value(headers, "content-type") or ""
        if content_type.startswith("text/event-stream") and not headers.end_of_stream:
            self.streaming = True  # watch the body: its first chunk is the first token
            return protocol.CONTINUE_RESPONSE_HEADERS
        # A complete answer (engines send non-streamed headers after generating): done.
        self._finish(self.status)
        return protocol.SKIP_RESPONSE_BODY

    def _response_body(self, body: pb.HttpBody) -> bytes:
        if self.backend is None or self.finished:
            return protocol.CONTINUE_RESPONSE_BODY
        service = self.service
        now = self.last_event_at = service.clock()
        if self.streaming and not self.first_token and body.body:
            self.first_token = True
            self.ttft = now - self.picked_at
            self.deferred = True
        elif self.error_body is not None:
            room = service.config.error_body_bytes - len(self.error_body)
            if room > 0:
                self.error_body += body.body[:room]
        if body.end_of_stream:
            self._finish(self.status if self.status is not None else 502)
        return protocol.CONTINUE_RESPONSE_BODY

    # ------------------------------------------------------------- finish

    def _finish(self, status: int | str) -> None:
        """The request is over: report it (after the reply is written, see :meth:`run_deferred`)."""
        if self.finished or self.backend is None:
            return
        self.finished = True
        self.finish_status = status
        self.deferred = True

    def run_deferred(self) -> None:
        """Feedback and metrics of the messages handled so far; each runs once."""
        self.deferred = False
        service = self.service
        backend = self.backend
        if backend is None:
            return
        if self.decision_seconds is not None:
            service.metrics.picked(backend.name)
            service.metrics.decision.observe(self.decision_seconds)
            self.decision_seconds = None
        if self.ttft is not None:
            ttft, self.ttft = self.ttft, None
            service.balancer.on_first_token(backend, ttft, self.tokens)
            service.metrics.ttft(backend.name, ttft)
        if self.finish_status is None:
            return
        status, self.finish_status = self.finish_status, None
        body = bytes(self.error_body) if self.error_body else None
        if isinstance(status, int) and status >= 500 and body is not None:
            status = _envoy_local_failure(status, body)
        try:
            classification = service.balancer.on_finish(backend, status, body, self.headers,
                                                         first_token_seen=self.first_token, prompt_tokens=self.tokens)
            service.metrics.response(backend.name, classification.response_class.value)
        finally:
            service.in_flight[backend.name] = max(0, service.in_flight.get(backend.name, 1) - 1)
            if self.last_event_at:
                service.metrics.feedback_lag.observe(max(0.0, service.clock() - self.last_event_at))

    def close(self) -> None:
        """The stream ended (cleanly or not): finish a picked request exactly once."""
        if self.backend is not None and not self.finished:
            if self.status is not None and self.status >= 400:
                self._finish(self.status)  # the error status was seen; its body may be partial
            else:
                self.service.metrics.failures["stream_reset"].inc()
                if not self.last_event_at:
                    self.last_event_at = self.service.clock()
                self._finish(CLIENT_CLOSED)
        if self.deferred:
            self.run_deferred()


def _envoy_local_failure(status: int, body: bytes) -> int | str:
    """Envoy's own replies for failures that never reached an engine, as the balancer's status names."""
    text = body[:200].decode("latin-1", "replace")
    if status == 503 and text.startswith("upstream connect error") and (
        "connection failure" in text or "connection refused" in text or "connection timeout" in text
    ):
        return CONNECT_ERROR
    if status == 504 and text.startswith("upstream request timeout"):
        return TIMEOUT
    return status

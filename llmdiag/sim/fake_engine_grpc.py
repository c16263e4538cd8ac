"""An h2c gRPC streaming front end for the fake engine (``llmdiag fake-engine --grpc-port N``).

One server-streaming method, ``/llmdiag.fake.Engine/Generate``, on a plain
(h2c, no TLS) gRPC port next to the engine's HTTP port: a real HTTP/2 backend
for the http2 collector to watch, fed by the same engine model as the HTTP
API. Messages are JSON bytes, so no generated code is needed (grpcio's
generic handlers with identity serializers):

- request: ``{"prompt_tokens": int, "max_tokens": int}``;
- responses: ``{"tokens": n}`` per engine step that produced tokens, then
  ``{"finish_reason": "length", "completion_tokens": n}``.

A client that cancels (deadline, ``call.cancel()``) sends RST_STREAM(CANCEL);
the request is then aborted in the engine, as vLLM aborts a request whose
client went away. While the engine is crashed the call fails with
``UNAVAILABLE``. :func:`generate` is the matching client call.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc

from llmdiag.sim.engine_model import SimRequest

if TYPE_CHECKING:
    from llmdiag.sim.fake_engine import FakeEngine

__all__ = ["GENERATE_METHOD", "GrpcFrontend", "generate"]

SERVICE = "llmdiag.fake.Engine"
GENERATE_METHOD = f"/{SERVICE}/Generate"


def _identity(data: bytes) -> bytes:
    return data


class GrpcFrontend:
    """The engine's gRPC port. It uses the engine's own request bookkeeping, so TTFT, tokens and
    aborts of gRPC requests show on ``/metrics`` exactly like HTTP ones."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.server: grpc.aio.Server | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        handler = grpc.method_handlers_generic_handler(SERVICE, {
            "Generate": grpc.unary_stream_rpc_method_handler(
                self._generate, request_deserializer=_identity, response_serializer=_identity),
        })
        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers((handler,))
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if not self.port:
            raise OSError(f"cannot listen for gRPC on {host}:{port}")
        await self.server.start()
        return self.port

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=0.2)
            self.server = None

    async def _generate(self, request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        # Late import: fake_engine imports this module for --grpc-port.
        from llmdiag.sim.fake_engine import _Stream  # noqa: PLC0415

        engine = self.engine
        try:
            body = json.loads(request or b"{}")
            prompt = int(body.get("prompt_tokens", 16))
            output = int(body.get("max_tokens", 16))
            if prompt < 1 or output < 1:
                raise ValueError("prompt_tokens and max_tokens must be >= 1")
        except (ValueError, TypeError, AttributeError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"invalid request: {exc}")
            return
        if engine.model.down:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine is down")
            return
        rid = next(engine._ids)
        req = SimRequest(rid, prompt, output, arrival=engine.now())
        answer = engine.model.submit(req, engine.now())
        if not answer.accepted:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, answer.body or "rejected")
            return
        stream = _Stream(req, engine.now())
        engine._streams[rid] = stream
        engine._wake.set()
        try:
            while True:
                item = await stream.queue.get()
                if item is None:
                    break
                yield json.dumps({"tokens": item}).encode()
            if req.finished_at is None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "engine core died")
                return
            yield json.dumps({"finish_reason": "length", "completion_tokens": req.output}).encode()
        finally:
            engine._streams.pop(rid, None)
            if req.finished_at is None:
                # Cancelled (RST_STREAM from the client) or crashed: free its KV like vLLM's abort.
                engine.model.abort(req)
                engine._success.labels(engine.options.model, engine.options.engine_label, "abort").inc()


async def generate(channel: grpc.aio.Channel, prompt_tokens: int, max_tokens: int,
                   timeout: float | None = None) -> AsyncIterator[dict[str, Any]]:
    """Client side: stream the responses of one Generate call (raises ``grpc.aio.AioRpcError``)."""
    call = channel.unary_stream(GENERATE_METHOD, request_serializer=_identity, response_deserializer=_identity)
    request = json.dumps({"prompt_tokens": prompt_tokens, "max_tokens": max_tokens}).encode()
    async for message in call(request, timeout=timeout):
        yield json.loads(message)

"""The agent's HTTP endpoints (aiohttp), SPEC 3.4 and 6.4.

=================  ==========================================================  =====
path               body                                                        token
=================  ==========================================================  =====
``/metrics``       Prometheus text (:mod:`llmdiag.exporters.prometheus`)      yes
``/v1/penalties``  ``llmdiag.penalties/v1``                                    yes
``/v1/state``      ``llmdiag.state/v1`` (:class:`llmdiag.agent.loop.AgentState`) yes
``/healthz``       ``ok`` (200) while ticks are fresh, else 503 with the reason  no
=================  ==========================================================  =====

With a bearer token configured, every path but ``/healthz`` answers 401 without
``Authorization: Bearer <token>``. Handlers only read the latest immutable state.

The state changes once per tick and gateways poll ``/v1/penalties`` several times a tick, so
each body is built on the first request after a tick and served as it is until the next
(:class:`PerState`; ``/metrics``: :class:`llmdiag.exporters.prometheus.TickExposition`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from llmdiag.exporters.prometheus import TickExposition

__all__ = ["PerState", "build_app"]

S = TypeVar("S")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _dumps(obj: Any) -> str:
    """Strict JSON; a non-finite number anywhere (a rule's evidence, say) becomes null, never a 500."""
    try:
        return json.dumps(obj, allow_nan=False, separators=(",", ":"))
    except ValueError:
        return json.dumps(_finite(obj), allow_nan=False, separators=(",", ":"))


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


class PerState(Generic[S]):
    """``build(state) -> str``, called once per published state (compared by identity: a state is
    replaced, never mutated); :meth:`get` from any thread."""

    def __init__(self, build: Callable[[S], str]) -> None:
        self._build = build
        self._state: S | None = None
        self._body = ""
        self._lock = threading.Lock()
        #: How many bodies were built (tests).
        self.builds = 0

    def get(self, state: S) -> str:
        with self._lock:
            if self._state is not state:
                self._body = self._build(state)
                self._state = state
                self.builds += 1
            return self._body


def build_app(agent: Any, exposition: TickExposition, token: str | None) -> web.Application:
    """The aiohttp application over ``agent`` (:class:`llmdiag.agent.daemon.Agent`)."""
    expected = f"Bearer {token}".encode() if token else None

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if expected is not None and request.path != "/healthz":
            given = request.headers.get("Authorization", "").encode("utf-8", "replace")
            if not hmac.compare_digest(given, expected):
                agent.count_unauthorized()
                return web.Response(status=401, text="bearer token required\n",
                                    headers={"WWW-Authenticate": 'Bearer realm="llmdiag"'})
        return await handler(request)

    # Rendering a large state takes milliseconds: off the event loop, so that agent-check
    # answers never wait behind a scrape.
    async def metrics(request: web.Request) -> web.Response:
        body = await asyncio.get_running_loop().run_in_executor(None, exposition.render)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    ttl = agent.config.agent.penalties_ttl_seconds
    penalties_body = PerState(lambda s: _dumps(s.penalties(ttl).to_json()))
    state_body = PerState(lambda s: _dumps(s.to_json()))

    async def penalties(request: web.Request) -> web.Response:
        return web.Response(text=penalties_body.get(agent.state), content_type="application/json")

    async def state(request: web.Request) -> web.Response:
        snapshot = agent.state  # one state for the whole answer
        text = await asyncio.get_running_loop().run_in_executor(None, state_body.get, snapshot)
        return web.Response(text=text, content_type="application/json")

    async def healthz(request: web.Request) -> web.Response:
        ok, reason = agent.health()
        return web.Response(status=200 if ok else 503, text=reason + "\n")

    app = web.Application(middlewares=[auth], client_max_size=64 * 1024)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/penalties", penalties)
    app.router.add_get("/v1/state", state)
    app.router.add_get("/healthz", healthz)
    return app

"""Active health probes (SPEC 6.3, seed 002): a tiny real completion per backend.

Every ``probe_interval_seconds`` (30 s) each backend gets a 1-token completion
on its model with a ``probe_timeout_seconds`` (5 s) timeout, independent of
user traffic. Ejected and half-open backends are probed every
``probe_ejected_interval_seconds`` (5 s), so ``probe_successes`` (2) good
probes in a row bring an ejected backend back to half-open without waiting
out the ejection (one, after a refused connection: the engine restarted). Results go to :meth:`Balancer.on_probe`.

The HTTP client is injected (:class:`ProbeClient`); :class:`AiohttpProbeClient`
is the real one: ``POST {url}/v1/completions`` with ``max_tokens: 1``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from llmdiag.model import Backend
from llmdiag.router_feedback.balancer import Balancer
from llmdiag.router_feedback.breaker import BreakerState

__all__ = ["AiohttpProbeClient", "ProbeClient", "ProbeResult", "ProbeRunner"]

log = logging.getLogger(__name__)

#: Probe responses are tiny; never read more than this.
_MAX_BODY = 64 * 1024


@dataclass(frozen=True, slots=True)
class ProbeResult:
    ok: bool
    latency_seconds: float | None = None
    status: int | None = None
    detail: str = ""
    #: The connection was refused: nothing listens (the engine process is gone). Its end is strong
    #: evidence, so the balancer re-admits on the first good probe after one (issue 14).
    refused: bool = False


class ProbeClient(Protocol):
    async def probe(self, backend: Backend, model: str | None, timeout: float) -> ProbeResult: ...

    async def close(self) -> None: ...


class AiohttpProbeClient:
    """Posts a 1-token completion to the backend's OpenAI API.

    Without a model name it asks ``GET /v1/models`` for the first one (once,
    then cached). A probe is good when the answer is 200 with a ``choices`` list.
    """

    def __init__(self, prompt: str = "ping", session: Any = None) -> None:
        self._prompt = prompt
        self._session = session
        self._own_session = session is None
        self._models: dict[str, str] = {}

    async def _client(self) -> Any:
        if self._session is None:
            import aiohttp

            self._session = aiohttp.ClientSession()
        return self._session

    async def probe(self, backend: Backend, model: str | None, timeout: float) -> ProbeResult:
        import aiohttp

        session = await self._client()
        started = time.perf_counter()
        client_timeout = aiohttp.ClientTimeout(total=timeout)
        try:
            if model is None:
                model = self._models.get(backend.name) or await self._first_model(session, backend, client_timeout)
            payload: dict[str, Any] = {"prompt": self._prompt, "max_tokens": 1, "temperature": 0, "stream": False}
            if model:
                payload["model"] = model
            async with session.post(f"{backend.url}/v1/completions", json=payload, timeout=client_timeout) as resp:
                body = await resp.content.read(_MAX_BODY)
                latency = time.perf_counter() - started
                if resp.status != 200:
                    return ProbeResult(False, latency, resp.status, body[:200].decode("utf-8", "replace"))
                try:
                    import json

                    doc = json.loads(body)
                except ValueError:
                    return ProbeResult(False, latency, resp.status, "answer is not JSON")
                if not isinstance(doc, dict) or not isinstance(doc.get("choices"), list):
                    return ProbeResult(False, latency, resp.status, "answer has no choices")
                return ProbeResult(True, latency, resp.status)
        except asyncio.TimeoutError:
            return ProbeResult(False, time.perf_counter() - started, None, f"timeout after {timeout:g} s")
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            refused = isinstance(exc, ConnectionRefusedError) or isinstance(
                getattr(exc, "os_error", None), ConnectionRefusedError
            )
            return ProbeResult(False, time.perf_counter() - started, None, f"{type(exc).__name__}: {exc}", refused)

    async def _first_model(self, session: Any, backend: Backend, timeout: Any) -> str | None:
        async with session.get(f"{backend.url}/v1/models", timeout=timeout) as resp:
            if resp.status != 200:
                return None
            import json

            try:
                doc = json.loads(await resp.content.read(_MAX_BODY))
                model = doc["data"][0]["id"]
            except (ValueError, KeyError, IndexError, TypeError):
                return None
        if isinstance(model, str):
            self._models[backend.name] = model
            return model
        return None

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None


class ProbeRunner:
    """Schedules probes per backend and feeds results to the balancer.

    ``run_once()`` probes every backend that is due (concurrently) and returns
    the results; ``start()`` runs it in an asyncio task every ``tick_seconds``.
    ``clock`` decides what is due (defaults to the balancer's clock).
    """

    def __init__(self, balancer: Balancer, client: ProbeClient, clock: Callable[[], float] | None = None,
                 tick_seconds: float = 1.0) -> None:
        self._balancer = balancer
        self._client = client
        self._clock = clock or balancer.clock
        self._tick = tick_seconds
        self._last_at: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None
        self.probes_total = 0
        self.probe_failures_total = 0

    async def run_once(self) -> dict[str, ProbeResult]:
        cfg = self._balancer.config
        now = self._clock()
        due: list[Backend] = []
        for backend, state in self._balancer.probe_targets():
            # Interval by the current state, so a backend ejected since its last probe is probed soon.
            interval = cfg.probe_interval_seconds if state is BreakerState.CLOSED else cfg.probe_ejected_interval_seconds
            last = self._last_at.get(backend.name)
            if last is None or now - last >= interval:
                due.append(backend)
                self._last_at[backend.name] = now
        known = {b.name for b in self._balancer.backends}
        for name in [n for n in self._last_at if n not in known]:
            del self._last_at[name]
        if not due:
            return {}
        results = await asyncio.gather(*(self._probe(b) for b in due))
        out: dict[str, ProbeResult] = {}
        for backend, result in zip(due, results):
            self.probes_total += 1
            if not result.ok:
                self.probe_failures_total += 1
                log.info("probe of %s failed: %s", backend.name, result.detail or result.status)
            self._balancer.on_probe(backend, result.ok, refused=result.refused)
            out[backend.name] = result
        return out

    async def _probe(self, backend: Backend) -> ProbeResult:
        timeout = self._balancer.config.probe_timeout_seconds
        model = backend.models[0] if backend.models else None
        try:
            # The client has its own timeout; this one also bounds a client that ignores it.
            return await asyncio.wait_for(self._client.probe(backend, model, timeout), timeout + 1.0)
        except asyncio.TimeoutError:
            return ProbeResult(False, None, None, f"timeout after {timeout:g} s")
        except Exception as exc:  # a broken client must not stop probing the others
            log.warning("probe client failed on %s: %s", backend.name, exc)
            return ProbeResult(False, None, None, f"{type(exc).__name__}: {exc}")

    def start(self) -> asyncio.Task[None]:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="llmdiag-probes")
        return self._task

    async def _run(self) -> None:
        while True:
            try:
                await self.run_once()
            except Exception:  # keep probing; one bad round must not end health checking
                log.exception("probe round failed")
            await asyncio.sleep(self._tick)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self._client.close()

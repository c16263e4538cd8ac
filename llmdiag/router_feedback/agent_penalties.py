"""Node agents' penalties, pulled into a gateway's balancer (SPEC 3.4, 6.5).

Contract
--------
:class:`AgentPenalties` polls ``GET {agent}/v1/penalties`` on every node agent
(optional bearer token) and keeps the last good ``llmdiag.penalties/v1``
document per agent. :meth:`AgentPenalties.apply` maps the documents' backends
onto a :class:`~llmdiag.router_feedback.balancer.Balancer`'s backends and calls
``balancer.set_penalty(name, penalty, reasons)``:

* matching is by ``address`` (``ip:port``) first, then by ``name``: the agent
  knows an engine by its listening socket, the gateway by the URL it was
  given, and the two names are often different;
* a document applies only while it is fresh (``now - ts <= ttl_seconds``, wall
  clock). A stale document, an unreachable agent or a garbage answer never
  blocks routing: the backends it covered **fail open** (penalty back to 0), a
  warning is logged once per agent until it is fresh again, and counters move;
* when two fresh documents name the same backend, the higher penalty wins
  (each agent only sees part of the truth; the worse one is the safer bet);
* ``set_penalty`` is called only when a backend's penalty or reasons change,
  so the balancer's writer lock is not taken once a second per backend for
  nothing.

:meth:`AgentPenalties.run` is the async poll loop (fetch every agent
concurrently, then apply) for an aiohttp application; :meth:`apply` is
synchronous and takes ``now`` so callers with their own loop (LiteLLM's
strategy, the Envoy picker) and tests drive it directly.

Counters (for ``/metrics``): :attr:`fetch_errors` (per agent URL),
:attr:`stale_documents_total` (documents found past their ttl, each counted
once, not once per poll), :attr:`fetches_total`,
:attr:`unmatched_backends_total` (document entries that name no known
backend).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from llmdiag.model import BackendPenalty, PenaltiesDocument, Reason
from llmdiag.router_feedback.balancer import Balancer

__all__ = ["AgentPenalties", "AgentStatus", "FetchError"]

log = logging.getLogger(__name__)

#: A penalties document for a node with a few dozen engines is a few KiB.
MAX_DOCUMENT_BYTES = 1 << 20


class FetchError(Exception):
    """One agent could not give a usable document (the message says why)."""


@dataclass(slots=True)
class AgentStatus:
    """What is known about one agent (``/metrics`` and logs read it)."""

    url: str
    document: PenaltiesDocument | None = None
    #: Wall-clock time of the last good fetch.
    last_ok_ts: float | None = None
    last_error: str = ""
    fetch_errors_total: int = 0
    #: Whether the document was fresh at the last :meth:`AgentPenalties.apply`.
    fresh: bool = False
    warned: bool = False
    #: ``ts`` of the last stale document counted (each stale document counts once).
    stale_ts: float | None = None


class AgentPenalties:
    """Pulls ``/v1/penalties`` from node agents and applies them to a balancer.

    ``agents`` are base URLs (``http://10.0.0.7:9090``). ``clock`` is the wall
    clock (documents carry wall-clock ``ts``). ``interval`` is the poll period
    and ``timeout`` bounds one fetch, connect and read together.
    """

    def __init__(
        self,
        agents: Iterable[str],
        token: str | None = None,
        interval: float = 1.0,
        timeout: float = 1.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        urls = [a.rstrip("/") for a in agents]
        if len(set(urls)) != len(urls):
            raise ValueError(f"duplicate agent URLs: {sorted({u for u in urls if urls.count(u) > 1})}")
        if interval <= 0 or timeout <= 0:
            raise ValueError("interval and timeout must be > 0")
        self.agents: dict[str, AgentStatus] = {u: AgentStatus(u) for u in urls}
        self._headers = {"Accept": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self.interval = interval
        self.timeout = timeout
        self._clock = clock
        #: Backend name -> (penalty, reasons) last given to the balancer by us.
        self._applied: dict[str, tuple[float, tuple[Reason, ...]]] = {}
        self.fetches_total = 0
        self.stale_documents_total = 0
        self.unmatched_backends_total = 0
        self._unmatched_warned: set[str] = set()

    # ------------------------------------------------------------- counters

    @property
    def fetch_errors(self) -> dict[str, int]:
        """Fetch errors per agent URL."""
        return {u: s.fetch_errors_total for u, s in self.agents.items()}

    @property
    def applied(self) -> dict[str, float]:
        """Backend name -> the agent penalty currently applied (0 entries are dropped)."""
        return {n: p for n, (p, _) in self._applied.items() if p > 0.0}

    # ------------------------------------------------------------- fetching

    async def fetch_one(self, session: Any, url: str) -> PenaltiesDocument:
        """``GET {url}/v1/penalties`` and parse it; raises :class:`FetchError`."""
        import aiohttp  # the router_feedback layer is importable without aiohttp

        timeout = aiohttp.ClientTimeout(total=self.timeout)
        try:
            async with session.get(f"{url}/v1/penalties", headers=self._headers, timeout=timeout) as resp:
                if resp.status != 200:
                    raise FetchError(f"HTTP {resp.status}")
                body = await _read_capped(resp.content, MAX_DOCUMENT_BYTES + 1)
        except asyncio.TimeoutError:  # before ClientError: aiohttp's ServerTimeoutError is both
            raise FetchError(f"no answer within {self.timeout:g} s") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise FetchError(f"{type(exc).__name__}: {exc}") from None
        if len(body) > MAX_DOCUMENT_BYTES:
            raise FetchError(f"document larger than {MAX_DOCUMENT_BYTES} bytes")
        try:
            obj = json.loads(body)
            if not isinstance(obj, Mapping):
                raise ValueError("not a JSON object")
            return PenaltiesDocument.from_json(obj)
        except (ValueError, KeyError, TypeError) as exc:
            raise FetchError(f"not a penalties document: {type(exc).__name__}: {exc}") from None

    async def poll(self, session: Any) -> None:
        """Fetch every agent once, concurrently; failures are recorded, never raised."""
        urls = list(self.agents)
        results = await asyncio.gather(*(self.fetch_one(session, u) for u in urls), return_exceptions=True)
        now = self._clock()
        for url, result in zip(urls, results):
            status = self.agents[url]
            self.fetches_total += 1
            if isinstance(result, PenaltiesDocument):
                status.document = result
                status.last_ok_ts = now
                status.last_error = ""
            elif isinstance(result, FetchError):
                self._fetch_failed(status, str(result))
            elif isinstance(result, BaseException) and not isinstance(result, Exception):
                raise result  # CancelledError, KeyboardInterrupt: not ours to swallow
            else:
                self._fetch_failed(status, f"{type(result).__name__}: {result}")

    def _fetch_failed(self, status: AgentStatus, why: str) -> None:
        status.fetch_errors_total += 1
        if why != status.last_error:
            log.debug("penalties from %s: %s", status.url, why)
        status.last_error = why

    async def run(self, session: Any, balancer: Balancer, stop_event: asyncio.Event) -> None:
        """Poll and apply every :attr:`interval` until ``stop_event`` is set.

        On exit every penalty this poller set is taken back (fail open).
        """
        try:
            while not stop_event.is_set():
                await self.poll(session)
                self.apply(balancer, self._clock())
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop_event.wait(), self.interval)
        finally:
            self.release(balancer)

    # ------------------------------------------------------------- applying

    def apply(self, balancer: Balancer, now: float | None = None) -> dict[str, float]:
        """Apply the fresh documents to ``balancer``; returns name -> penalty now applied.

        Backends no fresh document covers go back to penalty 0 if we had set one.
        """
        now = self._clock() if now is None else now
        by_address: dict[str, str] = {}
        by_name: set[str] = set()
        for b in balancer.backends:
            by_address.setdefault(b.address, b.name)
            by_name.add(b.name)
        wanted: dict[str, tuple[float, tuple[Reason, ...]]] = {}
        for status in self.agents.values():
            doc = status.document
            fresh = doc is not None and doc.is_fresh(now)
            self._note_freshness(status, doc, fresh, now)
            if not fresh:
                continue
            for entry in doc.backends:  # type: ignore[union-attr]
                name = self._match(entry, by_address, by_name, status.url)
                if name is None:
                    continue
                current = wanted.get(name)
                if current is None or entry.penalty > current[0]:
                    wanted[name] = (float(entry.penalty), tuple(entry.reasons))
        for name in list(self._applied):
            if name not in wanted and name in by_name:
                wanted[name] = (0.0, ())
        for name, value in wanted.items():
            if self._applied.get(name) == value:
                continue
            balancer.set_penalty(name, value[0], value[1])
            if value[0] > 0.0 or value[1]:
                self._applied[name] = value
            else:
                self._applied.pop(name, None)
        # Forget backends the balancer no longer has.
        for name in [n for n in self._applied if n not in by_name]:
            del self._applied[name]
        return self.applied

    def release(self, balancer: Balancer) -> None:
        """Take back every penalty this poller set (shutdown, or agents removed)."""
        names = {b.name for b in balancer.backends}
        for name in list(self._applied):
            if name in names:
                balancer.set_penalty(name, 0.0, ())
        self._applied.clear()

    def _match(self, entry: BackendPenalty, by_address: Mapping[str, str], by_name: set[str], url: str) -> str | None:
        name = by_address.get(entry.address)
        if name is None and entry.name in by_name:
            name = entry.name
        if name is None:
            self.unmatched_backends_total += 1
            key = f"{url}|{entry.address}|{entry.name}"
            if key not in self._unmatched_warned and len(self._unmatched_warned) < 1000:
                self._unmatched_warned.add(key)
                log.info("penalties from %s: backend %s (%s) is not one of ours; ignored", url, entry.name, entry.address)
        return name

    def _note_freshness(self, status: AgentStatus, doc: PenaltiesDocument | None, fresh: bool, now: float) -> None:
        status.fresh = fresh
        if fresh:
            if status.warned:
                log.warning("penalties from %s are fresh again", status.url)
            status.warned = False
            return
        if doc is not None and doc.ts != status.stale_ts:
            status.stale_ts = doc.ts
            self.stale_documents_total += 1
        if status.warned:
            return
        status.warned = True
        if doc is None:
            why = status.last_error or "no document yet"
            log.warning("no penalties from agent %s (%s): its backends route without node penalties", status.url, why)
        else:
            age = now - doc.ts
            why = f"; last fetch failed: {status.last_error}" if status.last_error else (
                " (just fetched: the agent's tick loop is stuck or its clock is behind ours)" if status.last_ok_ts and now - status.last_ok_ts < doc.ttl_seconds else "")
            log.warning("penalties from agent %s are %.1f s old, past their %g s ttl%s: failing open (penalty 0)",
                        status.url, age, doc.ttl_seconds, why)


async def _read_capped(stream: Any, limit: int) -> bytes:
    """Read until EOF or ``limit`` bytes, whichever comes first (``read(n)`` returns one chunk)."""
    chunks: list[bytes] = []
    size = 0
    while size < limit:
        chunk = await stream.read(limit - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)

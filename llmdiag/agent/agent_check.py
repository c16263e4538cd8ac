"""The HAProxy agent-check listener (SPEC 6.4): one TCP port for any number of servers.

Per connection: read one ``agent-send`` line (``backend/server``, a bare server name or
``ip:port``), answer with :func:`llmdiag.exporters.agent_check.agent_check_reply` for that
backend in the latest agent state, close. Bad input never takes a server down and never
stalls the listener:

* no line within ``agent_check_timeout_seconds`` (a slow client, or HAProxy without
  ``agent-send``): answered ``ready up 100%``, counted as ``timeout``;
* a line longer than ``agent_check_max_line_bytes``, or not text: ``ready up 100%``,
  counted as ``too_long`` / ``bad_request``;
* an unknown name: ``ready up 100%``, counted as ``unknown`` and in
  ``llmdiag_agent_check_unknown_server_total`` with a warning logged once per name;
* more than ``agent_check_max_connections`` at once: closed without a reply (``rejected``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Mapping

from llmdiag.config.agent import AgentConfig
from llmdiag.exporters.agent_check import UNKNOWN_REPLY, agent_check_reply, find_backend
from llmdiag.model import BackendPenalty

__all__ = ["AgentCheckServer", "RESULTS"]

log = logging.getLogger("llmdiag.agent")

RESULTS = ("ok", "unknown", "timeout", "too_long", "bad_request", "rejected", "error")
_MAX_WARNED = 1000  # names warned about; bounded so a scanner cannot grow it


class AgentCheckServer:
    """asyncio TCP server; ``entries()`` returns the backends of the latest state by name."""

    def __init__(self, config: AgentConfig, entries: Callable[[], Mapping[str, BackendPenalty]]) -> None:
        self.config = config
        self._entries = entries
        self._server: asyncio.base_events.Server | None = None
        self._active = 0
        self._lock = threading.Lock()  # counters are read from the HTTP side
        self.requests: dict[str, int] = dict.fromkeys(RESULTS, 0)
        self.unknown_total = 0
        self._warned: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def sockets(self) -> list[tuple[str, int]]:
        return [s.getsockname()[:2] for s in (self._server.sockets if self._server else ())]

    def counters(self) -> tuple[dict[str, int], int]:
        with self._lock:
            return dict(self.requests), self.unknown_total

    def _count(self, result: str) -> None:
        with self._lock:
            self.requests[result] += 1

    async def start(self, host: str, port: int) -> None:
        # limit: a line longer than this raises in readline() instead of growing the buffer.
        self._server = await asyncio.start_server(self._serve, host, port, limit=self.config.agent_check_max_line_bytes,
                                                  backlog=min(1024, self.config.agent_check_max_connections * 2))

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if self._active >= self.config.agent_check_max_connections:
            self._count("rejected")
            writer.transport.abort()
            return
        self._active += 1
        if task is not None:
            self._tasks.add(task)
        try:
            reply, result = await self._answer(reader)
            self._count(result)
            writer.write(reply.encode("ascii"))
            await asyncio.wait_for(writer.drain(), self.config.agent_check_timeout_seconds)
        except (asyncio.TimeoutError, ConnectionError, OSError):
            pass  # the checker went away or does not read: nothing more to do for it
        except Exception:  # noqa: BLE001 - one bad connection must never stop the listener
            self._count("error")
            log.exception("agent-check connection failed")
        finally:
            self._active -= 1
            if task is not None:
                self._tasks.discard(task)
            if writer.transport.get_write_buffer_size():
                writer.transport.abort()  # a reply still unsent: the checker does not read, drop it
            else:
                writer.close()

    async def _answer(self, reader: asyncio.StreamReader) -> tuple[str, str]:
        timeout = self.config.agent_check_timeout_seconds
        try:
            raw = await asyncio.wait_for(reader.readuntil(b"\n"), timeout)
        except asyncio.TimeoutError:
            return UNKNOWN_REPLY, "timeout"
        except asyncio.LimitOverrunError:
            return UNKNOWN_REPLY, "too_long"
        except asyncio.IncompleteReadError as exc:
            raw = exc.partial  # the checker half-closed after its line without a newline
            if not raw:
                return UNKNOWN_REPLY, "bad_request"
        try:
            name = raw.decode("ascii").strip()
        except UnicodeDecodeError:
            return UNKNOWN_REPLY, "bad_request"
        if not name or not name.isprintable():
            return UNKNOWN_REPLY, "bad_request"
        entry = find_backend(name, self._entries())
        if entry is None:
            with self._lock:
                self.unknown_total += 1
                first = name not in self._warned and len(self._warned) < _MAX_WARNED
                if first:
                    self._warned.add(name)
            if first:
                log.warning("agent-check for unknown server %r: answered ready up 100%% (fail open)", name)
            return UNKNOWN_REPLY, "unknown"
        return agent_check_reply(entry, self.config.agent_check_maxconn), "ok"

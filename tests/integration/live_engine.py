"""A real fake engine on 127.0.0.1 (ephemeral port) under a small real load, in a background thread.

``with loaded_engine("crash:start=2,down=60", rps=20) as engine:`` starts
:class:`~llmdiag.sim.fake_engine.FakeEngine` with that fault schedule and an
open-loop client sending ``rps`` short completions per second over aiohttp (none
with ``rps=0``);
everything stops when the block ends (bounded: the thread is joined with a
timeout). ``engine.url`` is its address; ``engine.statuses`` counts the HTTP
statuses (or ``"refused"``) the client saw.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import aiohttp

from llmdiag.sim.fake_engine import FakeEngine, FakeEngineOptions
from llmdiag.sim.faults import parse_faults

REPO = Path(__file__).resolve().parents[2]


class _RecordingEngine(FakeEngine):
    """A fake engine that notes, for every ``/metrics`` request, the client's port and its
    ``Connection`` header (llmdiag's kept-alive scrapes send none; one-shot GETs, such as
    other processes' engine discovery, send ``close``)."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.metrics_requests: list[tuple[int, str]] = []

    async def _metrics(self, request):  # type: ignore[no-untyped-def]
        peer = request.transport.get_extra_info("peername") if request.transport else None
        self.metrics_requests.append((peer[1] if peer else 0, request.headers.get("Connection", "").lower()))
        return await super()._metrics(request)


class LoadedEngine:
    def __init__(self, faults: str, rps: float) -> None:
        self.faults, self.rps = faults, rps
        self.url = ""
        self.statuses: collections.Counter[str] = collections.Counter()
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self.error: BaseException | None = None
        self.engine: _RecordingEngine | None = None

    @property
    def metrics_requests(self) -> list[tuple[int, str]]:
        """``(client port, Connection header)`` of every /metrics request so far."""
        return list(self.engine.metrics_requests) if self.engine is not None else []

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        engine = self.engine = _RecordingEngine(FakeEngineOptions(port=0, faults=parse_faults(self.faults)))
        try:
            await engine.start()
            self.url = engine.url
            self._ready.set()
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
                tasks: set[asyncio.Task[None]] = set()
                while self.rps > 0 and not self._stop.is_set():
                    task = asyncio.create_task(self._one(session))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._stop.wait(), 1.0 / self.rps)
                await self._stop.wait()
                for task in list(tasks):
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            self.error = exc
            self._ready.set()
        finally:
            await engine.stop()

    async def _one(self, session: aiohttp.ClientSession) -> None:
        try:
            async with session.post(f"{self.url}/v1/completions", json={"prompt": "hello there", "max_tokens": 8}) as resp:
                await resp.read()
                self.statuses[str(resp.status)] += 1
        except aiohttp.ClientConnectorError:
            self.statuses["refused"] += 1
        except (aiohttp.ClientError, asyncio.TimeoutError):
            self.statuses["failed"] += 1

    def __enter__(self) -> LoadedEngine:
        self._thread.start()
        if not self._ready.wait(10) or self.error is not None:
            raise RuntimeError(f"fake engine did not start: {self.error}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)


def loaded_engine(faults: str = "", rps: float = 20.0) -> LoadedEngine:
    return LoadedEngine(faults, rps)


def llmdiag_process(*args: str, cwd: Path) -> subprocess.Popen[str]:
    """``python -m llmdiag.cli ARGS`` started in the background (the caller waits for it)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "llmdiag.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)


def tcp_ports_of(pid: int, remote_port: int) -> set[int]:
    """Local ports of the TCP sockets process ``pid`` holds open towards ``remote_port``
    (its fds' socket inodes matched in /proc/net/tcp and tcp6)."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        return set()
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, remote, inode = fields[1], fields[2], fields[9]
            if inode in inodes and int(remote.rsplit(":", 1)[1], 16) == remote_port:
                ports.add(int(local.rsplit(":", 1)[1], 16))
    return ports


def llmdiag(*args: str, cwd: Path, timeout: float = 60.0, config: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``python -m llmdiag.cli ARGS`` from this checkout (no shell) in ``cwd`` (a test's
    tmp_path), with an optional config text written there."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-m", "llmdiag.cli"]
    if config is not None:
        path = cwd / "llmdiag-test.toml"
        path.write_text(config)
        argv += ["--config", str(path)]
    return subprocess.run([*argv, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)

"""``llmdiag agent``: the long-running node process (SPEC 3.4, 6.4, 9).

Two threads of control:

* the **tick thread** builds the collectors once (BPF compiled and attached once), then every
  ``[agent] interval_seconds`` collects a snapshot (collectors block: scrapes, /proc, BPF maps),
  runs :meth:`AgentLoop.observe` and publishes the new immutable state and telemetry by
  reference. A tick that runs late skips the missed slots (counted) instead of bunching up.
  Every ``discover_interval_seconds`` it re-resolves the backends in a helper thread:
  engines that appear later are added (discovery, when no backends are configured), an
  engine whose pid changed or whose counters went down is marked restarted (warm-up ramp);
  a backend once seen is kept (an engine that crashed shows as down, it does not vanish);
* the **asyncio loop** serves HTTP (:mod:`llmdiag.agent.http`), the HAProxy agent-check port
  (:mod:`llmdiag.agent.agent_check`) and the active probes (:mod:`llmdiag.agent.probes`);
  it only reads the published state.

SIGTERM (or Ctrl-C): listeners close, the tick thread stops and the collectors close (BPF
detached), within 5 s; exit 0 (130 for Ctrl-C).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import gc
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector

from llmdiag.agent import bpf_stats
from llmdiag.agent.agent_check import AgentCheckServer
from llmdiag.agent.loop import AgentLoop, AgentState
from llmdiag.agent.probes import AgentProber
from llmdiag.agent.wiring import COLLECTOR_FACTORIES, build_collectors, resolve_backends
from llmdiag.bpf.memory import Released, release_compiler_memory
from llmdiag.agent.ticker import collect_concurrently
from llmdiag.collectors.base import CollectorUsageError, GuardedCollector
from llmdiag.collectors.kube import PodMetadataReader
from llmdiag.config import Config
from llmdiag.config.agent import split_address
from llmdiag.exporters.prometheus import TICK_BUCKETS, AgentTelemetry, BackendInfo, LiveCollector, TickExposition
from llmdiag.model import Backend, BackendPenalty, CollectorStatus, Snapshot

__all__ = ["Agent", "run_agent"]

log = logging.getLogger("llmdiag.agent")

#: Seconds the agent may take to build its collectors (BPF compiles) before /healthz says it is stuck.
STARTUP_GRACE_SECONDS = 120.0
#: Exit status for a usage mistake (sysexits EX_USAGE), as the command line uses it.
EX_USAGE = 64
#: SIGTERM to exit, at most (SPEC: within 5 s); the tick thread gets what is left after the listeners.
SHUTDOWN_SECONDS = 4.5


class Agent:
    """The agent's state machine; :meth:`run` serves until :meth:`stop` (or a signal)."""

    def __init__(self, config: Config, *, token: str | None = None, backends: list[Backend] | None = None,
                 clock: Callable[[], float] = time.time, freeze_heap: bool = False) -> None:
        self.config = config
        #: Move what start-up allocated out of the cyclic GC's reach once the collectors are built
        #: (:meth:`_freeze_startup_heap`); the command line turns it on, in-process uses leave it off.
        self.freeze_heap = freeze_heap
        #: Objects frozen after start-up (0: not done).
        self.frozen_objects = 0
        self.token = token or None
        self.clock = clock
        self.hostname = config.agent.hostname or socket.gethostname()
        # One reader for the agent's life: it caches each pid's Kubernetes labels.
        self._kube = PodMetadataReader(config.proc.proc_root, os.environ.get("NODE_NAME"))
        self.backends = list(backends) if backends is not None else resolve_backends(config, self._kube)
        self.loop = AgentLoop(config, self.backends, clock=clock, keep_closed=config.agent.keep_closed_diagnoses)
        # /metrics: what one tick published is rendered once and served until the next tick;
        # the counters that move between ticks and the process's own figures, at every scrape.
        self.live_registry = CollectorRegistry(auto_describe=False)
        self.live_registry.register(LiveCollector(self._live_telemetry))
        ProcessCollector(registry=self.live_registry)  # process_resident_memory_bytes, process_cpu_seconds_total, ...
        self.exposition = TickExposition(lambda: (self.loop.state, self._telemetry), self.live_registry)
        self.agent_check = AgentCheckServer(config.agent, self._entries) if config.agent.agent_check_listen else None
        self.prober: AgentProber | None = None
        self.fatal: str | None = None
        #: The fatal error was the user's input (a config value a collector rejects): exit 64.
        self.usage_error = False
        #: What :meth:`_release_compiler_memory` did (None: not done, no BPF or turned off).
        self.compiler_memory: Released | None = None
        self.http_address: tuple[str, int] | None = None
        self.agent_check_address: tuple[str, int] | None = None
        #: Engines the engine collector detected (backend name -> engine), for backends given without one.
        self._detected_engines: dict[str, str] = {}
        self._telemetry = AgentTelemetry(backends=self._backend_info())
        self._opened: dict[tuple[str, str], int] = {}
        self._started = time.monotonic()
        self._last_tick_mono: float | None = None
        self._built_mono: float | None = None
        self._stop = threading.Event()
        self._async_stop: asyncio.Event | None = None
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._tick_thread, name="llmdiag-ticks", daemon=True)
        self._collectors: list[GuardedCollector] = []
        self._entries_cache: tuple[AgentState | None, dict[str, BackendPenalty]] = (None, {})
        self._unauthorized = 0
        self._resets: dict[str, float] = {}
        self.collectors_closed = threading.Event()
        self._runner: Any = None
        self._collect_pool: concurrent.futures.ThreadPoolExecutor | None = None
        #: Seconds each collector took in the last tick (benchmarks, debugging).
        self.collector_seconds: dict[str, float] = {}

    # -- reading (any thread) ---------------------------------------------------------
    @property
    def state(self) -> AgentState:
        return self.loop.state

    def health(self) -> tuple[bool, str]:
        """``(ok, reason)`` for /healthz: fresh ticks, or why not."""
        if self.fatal:
            return False, f"agent failed: {self.fatal}"
        stale = self.config.agent.stale_after_seconds
        now = time.monotonic()
        last = self._last_tick_mono
        if last is None:
            built = self._built_mono
            if built is None:  # compiling BPF programs takes seconds: a grace period, then stuck
                waited = now - self._started
                if waited <= STARTUP_GRACE_SECONDS:
                    return True, f"starting: building collectors ({waited:.0f} s)"
                return False, f"tick loop stuck: collectors still building {waited:.0f} s after start"
            if now - built > stale:
                return False, f"tick loop stuck: the first tick has not finished {now - built:.1f} s after the collectors started"
            return True, "starting: first tick"
        age = now - last
        if age > stale:
            return False, f"tick loop stuck: last tick {age:.1f} s ago (limit {stale:g} s)"
        return True, f"ok: last tick {age:.2f} s ago, {self.state.ticks} ticks"

    def count_unauthorized(self) -> None:
        """An HTTP request without the right token (asyncio thread only)."""
        self._unauthorized += 1

    def _entries(self) -> Mapping[str, BackendPenalty]:
        """The latest state's backends as penalties entries, rebuilt once per state (agent-check)."""
        state = self.loop.state
        cached, entries = self._entries_cache
        if cached is not state:
            entries = {name: b.as_penalty() for name, b in state.backends.items()}
            self._entries_cache = (state, entries)
        return entries

    def _live_telemetry(self) -> AgentTelemetry:
        """What moves between ticks, read at scrape time (the rest is not read): the asyncio
        thread's counters, and the BPF programs' run-time statistics (``/proc/self/fdinfo``: a
        file read per program, so once per scrape rather than once per tick)."""
        try:
            run_time, run_count = bpf_stats.program_stats(self._collectors)
        except Exception as exc:  # noqa: BLE001 - a metric must never break the scrape
            log.debug("BPF program statistics unreadable: %s", exc)
            run_time, run_count = {}, {}
        extra: dict[str, Any] = {"http_unauthorized_total": self._unauthorized, "bpf_run_time_seconds": run_time,
                                 "bpf_run_count": run_count}
        if self.agent_check is not None:
            extra["agent_check_requests"], extra["agent_check_unknown_server_total"] = self.agent_check.counters()
        return AgentTelemetry(**extra)

    def _backend_info(self) -> tuple[BackendInfo, ...]:
        return tuple(BackendInfo(b.name, b.address, b.engine or self._detected_engines.get(b.name, ""),
                                 b.labels.get("pod", ""), b.labels.get("namespace", ""),
                                 b.labels.get("container", ""), b.labels.get("node", "")) for b in self.backends)

    def _notice_engines(self) -> bool:
        """Take the engines the engine collector detected (``--backend URL`` gives none); True when new.

        The snapshot carries signals, not the engine's name: the collector's last scrape
        of each backend knows the dialect it detected (kept while the backend is down).
        """
        found: dict[str, str] = {}
        for c in self._collectors:
            if c.name == "engine":
                results = getattr(c.inner, "results", None) or {}
                found = {name: r.engine for name, r in results.items() if getattr(r, "engine", None)}
        if not found or all(self._detected_engines.get(n) == e for n, e in found.items()):
            return False
        self._detected_engines.update(found)
        return True

    # -- the tick thread ----------------------------------------------------------------
    def _tick_thread(self) -> None:
        try:
            collectors, unavailable = build_collectors(self.config, self.backends)
        except BaseException as exc:  # noqa: BLE001 - reported by /healthz and the exit status
            self.usage_error = isinstance(exc, CollectorUsageError)
            self.fatal = f"collectors failed to start: {type(exc).__name__}: {exc}"
            log.error("%s", self.fatal)
            self.collectors_closed.set()
            self._wake_async()
            return
        self._collectors = collectors
        self._release_compiler_memory()
        self._freeze_startup_heap()
        self._built_mono = time.monotonic()
        interval = self.config.agent.interval_seconds
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="llmdiag-discovery")
        self._collect_pool = concurrent.futures.ThreadPoolExecutor(max(1, len(collectors)),
                                                                   thread_name_prefix="llmdiag-collect")
        pending: concurrent.futures.Future[list[Backend]] | None = None
        next_refresh = time.monotonic() + self.config.agent.discover_interval_seconds
        try:
            next_tick = time.monotonic()
            while not self._stop.is_set():
                self._tick(unavailable)
                if pending is not None and pending.done():
                    self._apply_backends(pending)
                    pending = None
                if pending is None and time.monotonic() >= next_refresh:
                    pending = pool.submit(resolve_backends, self.config, self._kube)
                    next_refresh = time.monotonic() + self.config.agent.discover_interval_seconds
                next_tick += interval
                late = time.monotonic() - next_tick
                if late > 0:
                    missed = math.floor(late / interval) + 1
                    self._count_missed(missed)
                    next_tick += missed * interval
                self._stop.wait(max(0.0, next_tick - time.monotonic()))
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
            self._collect_pool.shutdown(wait=True)
            for c in self._collectors:
                c.close()
            self.collectors_closed.set()

    def _release_compiler_memory(self) -> None:
        """Once every BPF program is compiled and loaded, give back what bcc's clang and LLVM
        left resident (:mod:`llmdiag.bpf.memory`): ~50 MiB of heap and ~75 MiB of mapped code
        with the tcp and cuda programs. Only where bcc was loaded; ``[agent]
        release_compiler_memory = false`` keeps everything."""
        if "bcc" not in sys.modules or not self.config.agent.release_compiler_memory:
            return
        try:
            released = release_compiler_memory()
        except Exception as exc:  # noqa: BLE001 - an optimisation: never a reason to stop the agent
            log.warning("releasing the BPF compiler's memory failed: %s", exc)
            return
        self.compiler_memory = released
        log.info("BPF programs loaded; released the compiler's memory: %s", released.describe())

    def _freeze_startup_heap(self) -> None:
        """``gc.freeze()`` what start-up built (modules, bcc's objects, the collectors): it lives as
        long as the agent, so every full collection only walked it again (~60k objects, ~60 ms a
        pass at 16 backends). Frozen, a full pass walks what the ticks allocate. Only with
        ``freeze_heap`` (the command line): in a test process it would pin the test's heap."""
        if not self.freeze_heap:
            return
        gc.collect()
        gc.freeze()
        self.frozen_objects = gc.get_freeze_count()
        log.debug("froze %d start-up objects out of the cyclic GC", self.frozen_objects)

    def _tick(self, unavailable: Mapping[str, CollectorStatus]) -> None:
        started = time.perf_counter()
        assert self._collect_pool is not None
        try:
            snap, self.collector_seconds = collect_concurrently(self._collectors, self.clock(), self.hostname,
                                                                self._collect_pool)
            snap.collectors.update(unavailable)
            collect_seconds = time.perf_counter() - started
            state = self.loop.observe(snap, collect_seconds)
            self._notice_resets(snap)
            result = self.loop.last_result
            for d in result.opened if result is not None else ():
                key = (d.kind, d.severity.value)
                self._opened[key] = self._opened.get(key, 0) + 1
            lost = bpf_stats.lost_events(self._collectors)
        except Exception:  # noqa: BLE001 - a bug in one tick must not end the agent: log, count, go on
            log.exception("tick failed")
            self._count_missed(1)
            return
        elapsed = state.last_tick_seconds or (time.perf_counter() - started)
        if self._notice_engines():
            self._telemetry = dataclasses.replace(self._telemetry, backends=self._backend_info())
        old = self._telemetry
        counts = tuple(n + (1 if (i == len(TICK_BUCKETS) or elapsed <= TICK_BUCKETS[i]) else 0)
                       for i, n in enumerate(old.tick_bucket_counts))
        self._telemetry = AgentTelemetry(
            ticks_total=old.ticks_total + 1, ticks_missed_total=old.ticks_missed_total, tick_bucket_counts=counts,
            tick_seconds_sum=old.tick_seconds_sum + elapsed, last_tick_timestamp=snap.ts, backends=old.backends,
            diagnoses_opened=dict(self._opened), bpf_lost_events=lost, collector_seconds=dict(self.collector_seconds),
        )
        self._last_tick_mono = time.monotonic()

    def _count_missed(self, n: int) -> None:
        self._telemetry = dataclasses.replace(self._telemetry, ticks_missed_total=self._telemetry.ticks_missed_total + n)

    def _notice_resets(self, snap: Snapshot) -> None:
        """An engine whose counters went down restarted: its score ramps up again."""
        for name, signals in snap.backends.items():
            resets = signals.get("counter_resets_total")
            if not isinstance(resets, (int, float)) or isinstance(resets, bool):
                continue
            before = self._resets.get(name)
            self._resets[name] = resets
            if before is not None and resets > before and name in {b.name for b in self.loop.backends}:
                log.warning("backend %s restarted (its counters went down): warming up again", name)
                self.loop.mark_restarted(name)

    def _apply_backends(self, future: concurrent.futures.Future[list[Backend]]) -> None:
        try:
            found = future.result()
        except Exception as exc:  # noqa: BLE001 - discovery is best effort
            log.warning("re-resolving backends failed: %s", exc)
            return
        old = {b.name: b for b in self.backends}
        merged = dict(old)
        for b in found:
            merged[b.name] = b
        added = [n for n in merged if n not in old]
        moved = [n for n in merged if n in old and merged[n].url != old[n].url]
        restarted = [n for n in merged if n in old and old[n].pid and merged[n].pid and merged[n].pid != old[n].pid]
        gained_pid = [n for n in merged if n in old and not old[n].pid and merged[n].pid]
        if not (added or moved or restarted or gained_pid):
            return
        self.backends = list(merged.values())
        log.warning("backends changed: added %s, restarted %s, moved %s", added or "-", restarted or "-", moved or "-")
        self.loop.set_backends(self.backends)
        for name in restarted:
            self.loop.mark_restarted(name)
        for c in self._collectors:
            setter = getattr(c.inner, "set_backends", None)
            if setter is not None:
                setter(self.backends)
            elif c.name == "engine" and (added or moved):
                self._replace_collector(c)
        self._telemetry = dataclasses.replace(self._telemetry, backends=self._backend_info())

    def _replace_collector(self, old: GuardedCollector) -> None:
        """Rebuild a cheap collector for a new backend set (the BPF ones keep theirs: no recompiles)."""
        try:
            fresh = GuardedCollector(COLLECTOR_FACTORIES[old.name](self.config, self.backends))
        except Exception as exc:  # noqa: BLE001
            log.warning("rebuilding collector %s failed: %s (keeping the old one)", old.name, exc)
            return
        fresh.errors_total = old.errors_total
        self._collectors = [fresh if c is old else c for c in self._collectors]
        old.close()

    # -- serving -----------------------------------------------------------------------
    def stop(self) -> None:
        """Ask :meth:`run` to shut down (thread-safe)."""
        self._stop.set()
        self._wake_async()

    def _wake_async(self) -> None:
        if self._aloop is not None and self._async_stop is not None:
            self._aloop.call_soon_threadsafe(self._async_stop.set)

    async def run(self, on_ready: Callable[[Agent], None] | None = None) -> int:
        """Serve until :meth:`stop` or SIGTERM/SIGINT; 0 on SIGTERM or stop(), 130 on SIGINT, 1 when the agent failed."""
        from aiohttp import web  # noqa: PLC0415 - only the daemon needs the server

        from llmdiag.agent.http import build_app  # noqa: PLC0415

        self._aloop = asyncio.get_running_loop()
        self._async_stop = asyncio.Event()
        interrupted: list[int] = []
        for signum in (signal.SIGTERM, signal.SIGINT):
            try:
                self._aloop.add_signal_handler(signum, self._on_signal, signum, interrupted)
            except (NotImplementedError, RuntimeError, ValueError):
                pass  # not the main thread (tests): stop() is the way
        runner = web.AppRunner(build_app(self, self.exposition, self.token), access_log=None, handle_signals=False,
                               shutdown_timeout=1.0)
        await runner.setup()
        self._runner = runner
        try:
            site = web.TCPSite(runner, self.config.agent.listen_host, self.config.agent.listen_port,
                               reuse_address=True)
            await site.start()
            server = getattr(site, "_server", None)
            sockets = getattr(server, "sockets", None) or []
            self.http_address = sockets[0].getsockname()[:2] if sockets else (self.config.agent.listen_host,
                                                                               self.config.agent.listen_port)
            if self.agent_check is not None:
                host, port = split_address(self.config.agent.agent_check_listen, "agent_check_listen")
                await self.agent_check.start(host, port)
                self.agent_check_address = self.agent_check.sockets[0]
            self._thread.start()
            if self.config.agent.probes:
                self.prober = AgentProber(lambda: self.loop.balancer)
                self.prober.start()
            if on_ready is not None:
                on_ready(self)
            await self._async_stop.wait()
        finally:
            await self._shutdown()
        if self.fatal:
            return EX_USAGE if self.usage_error else 1
        return 130 if interrupted and interrupted[0] == signal.SIGINT else 0

    def _on_signal(self, signum: int, interrupted: list[int]) -> None:
        interrupted.append(signum)
        log.warning("%s: shutting down", signal.Signals(signum).name)
        self.stop()

    async def _shutdown(self) -> None:
        deadline = time.monotonic() + SHUTDOWN_SECONDS
        self._stop.set()
        if self.prober is not None:
            await self.prober.close()
        if self.agent_check is not None:
            try:
                await asyncio.wait_for(self.agent_check.close(), 1.0)
            except asyncio.TimeoutError:
                log.warning("agent-check listener did not close within 1 s")
        if self._runner is not None:
            try:
                await asyncio.wait_for(self._runner.cleanup(), 1.5)
            except asyncio.TimeoutError:
                log.warning("HTTP server did not close within 1.5 s")
        if self._thread.is_alive():
            left = max(0.1, deadline - time.monotonic())
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, left)
            if self._thread.is_alive():
                log.warning("tick thread still busy after %.1f s (a collector is blocking); exiting anyway", SHUTDOWN_SECONDS)


def run_agent(config: Config, token: str | None, *, announce: Callable[[str], None] | None = None) -> int:
    """Build and run the agent in this thread's event loop (the command line entry)."""
    agent = Agent(config, token=token, freeze_heap=True)

    def ready(a: Agent) -> None:
        assert a.http_address is not None
        host, port = a.http_address
        parts = [f"llmdiag agent on {a.hostname}: http://{_hostport(host, port)} (/metrics /v1/penalties /v1/state /healthz)"]
        if a.agent_check_address is not None:
            parts.append(f"agent-check {_hostport(*a.agent_check_address)}")
        parts.append(f"{len(a.backends)} backend(s): {', '.join(b.name for b in a.backends) or 'none yet'}")
        (announce or (lambda text: print(text, file=sys.stderr, flush=True)))("; ".join(parts))

    return asyncio.run(agent.run(ready))


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


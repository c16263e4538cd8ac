"""The demo fleet: fake engines on loopback behind a naive round-robin load, with a fault script.

This is what ``llmdiag demo`` and ``llmdiag top --demo`` watch when no real
engines are at hand. Everything is real except the GPUs: real HTTP (and h2c
gRPC) servers on 127.0.0.1 speaking the OpenAI API with vLLM-named
``/metrics`` (:mod:`llmdiag.sim.fake_engine`), and clients that stream
completions and give up (disconnect, cancel) when they lose patience.

The fault script (:func:`default_fleet`, times from ``fault_at``):

========== =========================================================== ===========================================
backend    what happens                                                 what llmdiag should name
========== =========================================================== ===========================================
vllm-0     nothing: the healthy control                                 nothing (warning or worse)
vllm-1     from ``fault_at`` a client that does not pool connections    ``connection_churn``
           sends ~25 tiny requests/s, one TCP connection each
           (``Connection: close``: TIME_WAIT piles up on the server)
vllm-2     at ``fault_at`` loses 80 % of its KV cache and slows to      ``kv_cache_saturation`` /
           0.25x (a throttled GPU) while ``/health`` stays 200          ``queue_avalanche`` / ``false_healthy``
vllm-3     at ``fault_at`` slows to 0.2x; impatient HTTP clients (2 s)  ``client_timeout_storm`` on ``vllm-3``
           disconnect and a gRPC client (2 s deadline) cancels its      and (RST_STREAM(CANCEL)) on
           streams on the engine's h2c gRPC port                        ``vllm-3-grpc``
vllm-4     crashes at ``fault_at + 30`` s, down 20 s, then restarts     ``backend_down``
           cold (slow warm-up)
========== =========================================================== ===========================================

``vllm-3-grpc`` is ``vllm-3``'s gRPC port as a backend of its own, with
``vllm-3``'s ``/metrics`` as its ``metrics_url``: the two backends report the
same engine metrics (TTFT, queue, KV), while the HTTP/2 signals (RST_STREAM)
are the gRPC port's own.

Request lengths of the background load are drawn from log-normal
distributions fitted to the Azure LLM inference conversation trace (input
median 1020 tokens, output median 129; ``../shared/data/traces/azure2023_conv.csv``),
so the demo needs no data files.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import socket
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp

from llmdiag.model import Backend
from llmdiag.sim.fake_engine import FakeEngine, FakeEngineOptions
from llmdiag.sim.faults import FaultSchedule, parse_faults

__all__ = ["DEMO_COLLECTORS", "DemoFleet", "FleetEngine", "LoadStats", "ScriptedClient", "default_clients",
           "default_fleet", "run_load"]

#: Collectors the demo runs; the kernel ones report "unavailable" where BPF cannot load.
DEMO_COLLECTORS = ("engine", "proc", "tcp", "timewait", "http2")

#: Suffix of the backend name of an engine's gRPC port (``vllm-3`` -> ``vllm-3-grpc``).
GRPC_SUFFIX = "-grpc"


@dataclass(frozen=True)
class FleetEngine:
    name: str
    profile: str = "llama-70b-a100-tp8"
    kv_capacity_tokens: int = 60_000
    faults: FaultSchedule = field(default_factory=FaultSchedule)
    grpc: bool = False  # also serve the h2c gRPC Generate method (backend ``<name>-grpc``)


@dataclass(frozen=True)
class ScriptedClient:
    """A client the fault script adds at ``start`` seconds: its own rate, target, patience and habits.

    ``pooled=False`` opens (and closes) one TCP connection per request, as a client
    without keep-alive does; ``protocol="grpc"`` streams from the target's gRPC port
    and cancels at ``timeout_s`` (RST_STREAM(CANCEL)); HTTP clients disconnect then.
    """

    name: str
    target: str
    rate_rps: float
    start: float
    timeout_s: float = 15.0
    pooled: bool = True
    protocol: str = "http"
    prompt_tokens: int | None = None  # None: drawn from the trace fit
    max_tokens: int | None = None


def default_fleet(fault_at: float = 15.0) -> list[FleetEngine]:
    """Five engines; the fault script of the module docstring."""
    kv_slow = parse_faults(f"kv_shrink:start={fault_at},factor=0.2;slowdown:start={fault_at},speed=0.25")
    slow = parse_faults(f"slowdown:start={fault_at},speed=0.2")
    crash = parse_faults(f"crash:start={fault_at + 30},down=20")
    return [FleetEngine("vllm-0"), FleetEngine("vllm-1"), FleetEngine("vllm-2", faults=kv_slow),
            FleetEngine("vllm-3", faults=slow, grpc=True), FleetEngine("vllm-4", faults=crash)]


def default_clients(fault_at: float = 15.0) -> list[ScriptedClient]:
    """The clients of the fault script: a connection churner on vllm-1, impatient ones on vllm-3."""
    return [
        ScriptedClient("no-keepalive", "vllm-1", rate_rps=25.0, start=fault_at, pooled=False, timeout_s=10.0,
                       prompt_tokens=16, max_tokens=1),
        ScriptedClient("impatient-http", "vllm-3", rate_rps=3.0, start=fault_at, timeout_s=2.0),
        ScriptedClient("impatient-grpc", "vllm-3", rate_rps=3.0, start=fault_at, timeout_s=2.0, protocol="grpc"),
    ]


@dataclass
class LoadStats:
    """What the clients saw."""

    sent: int = 0
    statuses: Counter[str] = field(default_factory=Counter)  # "200", "429", "timeout", "connect_error" ...
    ttfts: list[float] = field(default_factory=list)


def sample_lengths(rng: random.Random) -> tuple[int, int]:
    """(input, output) tokens: log-normal fits of the Azure conversation trace (p50 1020/129, p99 ~4100/600)."""
    prompt = int(min(8000, max(16, rng.lognormvariate(math.log(1020), 0.6))))
    output = int(min(600, max(8, rng.lognormvariate(math.log(129), 0.66))))
    return prompt, output


async def _one_request(session: aiohttp.ClientSession, url: str, model: str, prompt: int, output: int,
                       timeout_s: float, stats: LoadStats, close: bool = False) -> None:
    body = {"model": model, "prompt_tokens": prompt, "max_tokens": output, "stream": True}
    # ``Connection: close`` (an HTTP/1.0-style client): the server closes after the response,
    # so the TIME_WAIT piles up on the server's side, where its own counters see it.
    headers = {"Connection": "close"} if close else None
    start = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
                if resp.status != 200:
                    await resp.read()
                    stats.statuses[str(resp.status)] += 1
                    return
                first = True
                async for _line in resp.content:
                    if first:
                        stats.ttfts.append(time.monotonic() - start)
                        first = False
                stats.statuses["200"] += 1
    except TimeoutError:
        stats.statuses["timeout"] += 1  # the client gives up and disconnects mid-request
    except aiohttp.ClientConnectionError:
        stats.statuses["connect_error"] += 1
    except aiohttp.ClientPayloadError:
        stats.statuses["broken_stream"] += 1  # the engine died mid-stream


async def _one_grpc_request(channel: object, prompt: int, output: int, timeout_s: float, stats: LoadStats) -> None:
    import grpc  # noqa: PLC0415 - only the gRPC client needs it

    from llmdiag.sim.fake_engine_grpc import generate  # noqa: PLC0415

    start = time.monotonic()
    first = True
    try:
        async for _msg in generate(channel, prompt, output, timeout=timeout_s):  # type: ignore[arg-type]
            if first:
                stats.ttfts.append(time.monotonic() - start)
                first = False
        stats.statuses["grpc_ok"] += 1
    except grpc.aio.AioRpcError as exc:
        # DEADLINE_EXCEEDED: the client cancelled the stream (RST_STREAM CANCEL on the wire).
        stats.statuses[f"grpc_{exc.code().name.lower()}"] += 1


async def _arrivals(rate_rps: float, rng: random.Random, stop: asyncio.Event | None, end: float,
                    launch: object) -> None:
    """Poisson arrivals: call ``launch()`` (returns a coroutine) at ``rate_rps`` until ``end`` or ``stop``."""
    tasks: set[asyncio.Task[None]] = set()
    try:
        while time.monotonic() < end and not (stop and stop.is_set()):
            task = asyncio.create_task(launch())  # type: ignore[operator]
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            await asyncio.sleep(rng.expovariate(rate_rps))
    finally:
        # In-flight requests end before the session closes, whatever ended the loop.
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def run_load(urls: Sequence[str], model: str, rate_rps: float, duration_s: float, *, seed: int = 0,
                   client_timeout_s: float = 15.0, stats: LoadStats | None = None,
                   stop: asyncio.Event | None = None) -> LoadStats:
    """Poisson arrivals at ``rate_rps``, round robin over ``urls`` (the naive gateway), for ``duration_s``."""
    stats = stats if stats is not None else LoadStats()
    if not (rate_rps > 0 and math.isfinite(rate_rps)):
        raise ValueError(f"rate must be a finite number of requests per second > 0, got {rate_rps!r}")
    rng = random.Random(seed)
    rr = itertools.cycle(urls)
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)  # keep-alive pool; no TIME_WAIT storm of our own
    async with aiohttp.ClientSession(connector=connector) as session:
        def launch():  # type: ignore[no-untyped-def]
            stats.sent += 1
            prompt, output = sample_lengths(rng)
            return _one_request(session, next(rr), model, prompt, output, client_timeout_s, stats)

        await _arrivals(rate_rps, rng, stop, time.monotonic() + duration_s, launch)
    return stats


async def run_client(client: ScriptedClient, url: str, model: str, *, seed: int, stats: LoadStats,
                     stop: asyncio.Event, t0: float) -> None:
    """One scripted client: waits for its start time, then sends until ``stop``."""
    rng = random.Random(seed)
    delay = t0 + client.start - time.monotonic()
    if delay > 0:
        try:
            await asyncio.wait_for(stop.wait(), delay)
            return
        except TimeoutError:
            pass

    def lengths() -> tuple[int, int]:
        prompt, output = sample_lengths(rng)
        return client.prompt_tokens or prompt, client.max_tokens or output

    if client.protocol == "grpc":
        import grpc  # noqa: PLC0415

        async with grpc.aio.insecure_channel(url) as channel:
            def launch_grpc():  # type: ignore[no-untyped-def]
                stats.sent += 1
                return _one_grpc_request(channel, *lengths(), client.timeout_s, stats)

            await _arrivals(client.rate_rps, rng, stop, math.inf, launch_grpc)
        return
    # force_close: a new TCP connection per request (never reused).
    connector = aiohttp.TCPConnector(limit=0, force_close=not client.pooled)
    async with aiohttp.ClientSession(connector=connector) as session:
        def launch_http():  # type: ignore[no-untyped-def]
            stats.sent += 1
            return _one_request(session, url, model, *lengths(), client.timeout_s, stats, close=not client.pooled)

        await _arrivals(client.rate_rps, rng, stop, math.inf, launch_http)


def _hold_free_port() -> socket.socket:
    """A free loopback port, held by a bound socket that does not listen.

    The engine binds the same port later (both sockets set SO_REUSEADDR, and
    Linux lets a listener share a port with a bound socket that does not
    listen). Until then no ``bind(0)`` and no outgoing connection can be given
    the port, as they could if it were closed right after it was picked: the
    collectors are already built for it, so the engine must get exactly it."""
    sock = socket.socket()
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
    except OSError:
        sock.close()
        raise
    return sock


class DemoFleet:
    """Runs the fake engines, the round-robin load and the scripted clients in a background thread."""

    def __init__(self, engines: Sequence[FleetEngine] | None = None, *, rate_rps: float = 3.0,
                 model: str = "fake/llama-70b", seed: int = 0, client_timeout_s: float = 15.0,
                 clients: Sequence[ScriptedClient] | None = None, fault_at: float = 15.0) -> None:
        """Without ``engines`` and ``clients``: the default fault script starting at ``fault_at`` s."""
        self.specs = list(engines or default_fleet(fault_at))
        self.clients = list(default_clients(fault_at) if clients is None and engines is None else clients or ())
        self.fault_at = fault_at
        self.rate_rps = rate_rps
        self.model = model
        self.seed = seed
        self.client_timeout_s = client_timeout_s
        self.engines: list[FakeEngine] = []
        self.stats = LoadStats()
        self.client_stats: dict[str, LoadStats] = {c.name: LoadStats() for c in self.clients}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._stopped = False
        self._stop_requested = False
        self._ports: dict[str, tuple[int, int | None]] = {}
        self._held: list[socket.socket] = []  # the reserved ports, until the engines have bound them

    def reserve_ports(self) -> None:
        """Pick the engines' ports now (free ports from the OS), so that collectors can be built,
        and BPF compiled, before the engines start and the fault clock runs (idempotent)."""
        if self._ports:
            return
        for spec in self.specs:
            http = _hold_free_port()
            grpc = _hold_free_port() if spec.grpc else None
            self._held += [http] + ([grpc] if grpc else [])
            self._ports[spec.name] = (http.getsockname()[1], grpc.getsockname()[1] if grpc else None)

    def _release_ports(self) -> None:
        held, self._held = self._held, []
        for sock in held:
            sock.close()

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def urls(self) -> dict[str, str]:
        """Engine name -> ``http://127.0.0.1:PORT`` (after :meth:`reserve_ports` or :meth:`start`)."""
        if self.engines:
            return {spec.name: eng.url for spec, eng in zip(self.specs, self.engines)}
        return {name: f"http://127.0.0.1:{http}" for name, (http, _) in self._ports.items()}

    @property
    def grpc_urls(self) -> dict[str, str]:
        """gRPC backend name (``<engine>-grpc``) -> ``grpc://127.0.0.1:PORT``."""
        if self.engines:
            return {spec.name + GRPC_SUFFIX: f"grpc://{eng.options.host}:{eng.grpc_port}"
                    for spec, eng in zip(self.specs, self.engines) if eng.grpc_port}
        return {name + GRPC_SUFFIX: f"grpc://127.0.0.1:{grpc}" for name, (_, grpc) in self._ports.items() if grpc}

    def backends(self) -> list[Backend]:
        """The running engines as backends: HTTP ones, then the gRPC ports.

        A gRPC backend's ``metrics_url`` is its engine's HTTP ``/metrics``, so ``vllm-3`` and
        ``vllm-3-grpc`` report the same engine metrics (TTFT, queue, KV): one engine, two ports."""
        http = [Backend.from_url(url, name=name, engine="vllm", models=(self.model,)) for name, url in self.urls.items()]
        # The gRPC port is the same engine as its HTTP port: its metrics live at that port's /metrics.
        http_urls = self.urls
        grpc = [Backend.from_url(url, name=name, models=(self.model,),
                                 metrics_url=http_urls[name.removesuffix(GRPC_SUFFIX)] + "/metrics")
                for name, url in self.grpc_urls.items()]
        return http + grpc

    def describe(self) -> str:
        return f"{len(self.specs)} fake vLLM engines on 127.0.0.1, {self.rate_rps:g} req/s round robin"

    def start(self, timeout: float = 10.0) -> None:
        self._thread = threading.Thread(target=self._run, name="llmdiag-demo-fleet", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            self.stop()
            raise RuntimeError("demo fleet did not start in time")
        if self._error is not None:
            self.stop()
            raise RuntimeError(f"demo fleet failed to start: {self._error}") from self._error

    def stop(self) -> None:
        """Stop the clients and the engines (idempotent; safe from any thread but the fleet's)."""
        self._stop_requested = True
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:
                pass  # the loop already ended
        if self._thread is not None:
            self._thread.join(timeout=15)
        self._release_ports()
        self._stopped = True

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        t0 = time.monotonic()
        try:
            for i, spec in enumerate(self.specs):
                http_port, grpc_port = self._ports.get(spec.name, (0, 0 if spec.grpc else None))
                engine = FakeEngine(FakeEngineOptions(
                    port=http_port, model=self.model, profile=spec.profile, kv_capacity_tokens=spec.kv_capacity_tokens,
                    faults=spec.faults, seed=self.seed + i, grpc_port=grpc_port))
                self.engines.append(engine)
                await engine.start()
        except BaseException as exc:  # noqa: BLE001 - reported to the starting thread
            self._release_ports()
            self._error = exc
            self._ready.set()
            await self._stop_engines()
            return
        self._release_ports()  # the engines listen on them now
        self._ready.set()
        if self._stop_requested:  # stop() came while the engines were starting
            self._stop.set()
        by_name = dict(zip((s.name for s in self.specs), self.engines))
        tasks = []
        for i, client in enumerate(self.clients):
            engine = by_name.get(client.target)
            if engine is None:
                continue
            url = f"{engine.options.host}:{engine.grpc_port}" if client.protocol == "grpc" else engine.url
            tasks.append(asyncio.create_task(run_client(
                client, url, self.model, seed=self.seed + 100 + i, stats=self.client_stats[client.name],
                stop=self._stop, t0=t0)))
        try:
            await run_load([e.url for e in self.engines], self.model, self.rate_rps, math.inf, seed=self.seed,
                           client_timeout_s=self.client_timeout_s, stats=self.stats, stop=self._stop)
        finally:
            self._stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._stop_engines()

    async def _stop_engines(self) -> None:
        for engine in self.engines:
            try:
                await engine.stop()
            except Exception:  # noqa: BLE001 - stop the others whatever one does
                pass

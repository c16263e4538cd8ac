"""The demo fleet: fake engines on loopback, one of them going bad, behind a naive round-robin load.

This is what ``llmdiag demo`` watches when no real engines are at hand. It is
the situation from the seed articles: a round-robin gateway keeps feeding an
engine whose KV cache shrank and whose steps slowed down (a throttled GPU), while ``/health`` keeps
answering 200. Everything is real except the GPUs: real HTTP servers on
127.0.0.1 speaking the OpenAI API with vLLM-named ``/metrics``
(:mod:`llmdiag.sim.fake_engine`), and a load generator that streams
completions and gives up (disconnects) after a client timeout, as impatient
clients do.

Request lengths are drawn from log-normal distributions fitted to the Azure
LLM inference conversation trace (input median 1020 tokens, output median 129;
``../shared/data/traces/azure2023_conv.csv``), so the demo needs no data files.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp

from llmdiag.model import Backend
from llmdiag.sim.fake_engine import FakeEngine, FakeEngineOptions
from llmdiag.sim.faults import FaultSchedule, parse_faults

__all__ = ["DEMO_COLLECTORS", "DemoFleet", "FleetEngine", "LoadStats", "default_fleet", "run_load"]

#: Collectors the demo runs; the kernel ones report "unavailable" where BPF cannot load.
DEMO_COLLECTORS = ("engine", "proc", "tcp", "timewait", "http2")


@dataclass(frozen=True)
class FleetEngine:
    name: str
    profile: str = "llama-70b-a100-tp8"
    kv_capacity_tokens: int = 60_000
    faults: FaultSchedule = field(default_factory=FaultSchedule)


def default_fleet(fault_at: float = 15.0) -> list[FleetEngine]:
    """Three engines; ``vllm-2`` loses most of its KV cache and slows to 0.35x at ``fault_at`` seconds."""
    bad = parse_faults(f"kv_shrink:start={fault_at},factor=0.25;slowdown:start={fault_at},speed=0.35")
    return [FleetEngine("vllm-0"), FleetEngine("vllm-1"), FleetEngine("vllm-2", faults=bad)]


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
                       timeout_s: float, stats: LoadStats) -> None:
    body = {"model": model, "prompt_tokens": prompt, "max_tokens": output, "stream": True}
    start = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(f"{url}/v1/completions", json=body) as resp:
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


async def run_load(urls: Sequence[str], model: str, rate_rps: float, duration_s: float, *, seed: int = 0,
                   client_timeout_s: float = 15.0, stats: LoadStats | None = None,
                   stop: asyncio.Event | None = None) -> LoadStats:
    """Poisson arrivals at ``rate_rps``, round robin over ``urls`` (the naive gateway), for ``duration_s``."""
    stats = stats if stats is not None else LoadStats()
    rng = random.Random(seed)
    rr = itertools.cycle(urls)
    tasks: set[asyncio.Task[None]] = set()
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)  # keep-alive pool; no TIME_WAIT storm of our own
    if not (rate_rps > 0 and math.isfinite(rate_rps)):
        raise ValueError(f"rate must be a finite number of requests per second > 0, got {rate_rps!r}")
    async with aiohttp.ClientSession(connector=connector) as session:
        try:
            end = time.monotonic() + duration_s
            while time.monotonic() < end and not (stop and stop.is_set()):
                prompt, output = sample_lengths(rng)
                task = asyncio.create_task(_one_request(session, next(rr), model, prompt, output, client_timeout_s, stats))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                stats.sent += 1
                await asyncio.sleep(rng.expovariate(rate_rps))
        finally:
            # In-flight requests end before the session closes, whatever ended the loop.
            for task in list(tasks):
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return stats


class DemoFleet:
    """Runs the fake engines and the load in a background thread with its own event loop."""

    def __init__(self, engines: Sequence[FleetEngine] | None = None, *, rate_rps: float = 2.4,
                 model: str = "fake/llama-70b", seed: int = 0, client_timeout_s: float = 15.0) -> None:
        self.specs = list(engines or default_fleet())
        self.rate_rps = rate_rps
        self.model = model
        self.seed = seed
        self.client_timeout_s = client_timeout_s
        self.engines: list[FakeEngine] = []
        self.stats = LoadStats()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None

    @property
    def urls(self) -> dict[str, str]:
        """Engine name -> ``http://127.0.0.1:PORT``."""
        return {spec.name: eng.url for spec, eng in zip(self.specs, self.engines)}

    def backends(self) -> list[Backend]:
        """The running engines as backends (names, loopback URLs, this process's pid)."""
        return [Backend.from_url(url, name=name, engine="vllm", models=(self.model,)) for name, url in self.urls.items()]

    def describe(self) -> str:
        return f"{len(self.specs)} fake vLLM engines on 127.0.0.1, {self.rate_rps:g} req/s round robin"

    def start(self, timeout: float = 10.0) -> None:
        self._thread = threading.Thread(target=self._run, name="llmdiag-demo-fleet", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError("demo fleet did not start in time")
        if self._error is not None:
            raise RuntimeError(f"demo fleet failed to start: {self._error}") from self._error

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            for i, spec in enumerate(self.specs):
                engine = FakeEngine(FakeEngineOptions(
                    port=0, model=self.model, profile=spec.profile, kv_capacity_tokens=spec.kv_capacity_tokens,
                    faults=spec.faults, seed=self.seed + i))
                await engine.start()
                self.engines.append(engine)
        except BaseException as exc:  # noqa: BLE001 - reported to the starting thread
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            await run_load([e.url for e in self.engines], self.model, self.rate_rps, math.inf, seed=self.seed,
                           client_timeout_s=self.client_timeout_s, stats=self.stats, stop=self._stop)
        finally:
            for engine in self.engines:
                await engine.stop()

"""Open-loop load from a trace against any OpenAI-compatible endpoint (``llmdiag bench load``).

Each request is sent at its arrival time whatever happened to the earlier
ones (open loop: a slow server gets a growing backlog, as in production, not
fewer requests as with a closed loop of N clients). Requests are streamed
completions with the trace's prompt and output lengths: ``prompt_tokens``
(honoured by the fake engine; real engines ignore the field) plus a prompt of
about that many tokens, ``max_tokens`` and ``ignore_eos`` so engines generate
the full output. With several targets, requests go to them in turn (to
measure "direct to the engines, spread evenly" as a baseline).

A client hangs up (``timeout`` status) after ``timeout`` seconds without a
token, the first one included, as impatient clients do.

Measured per request: TTFT (send to the first streamed event), inter-token
latency (gaps between streamed events), E2E, the status (HTTP status, or
``timeout``, ``connect_error``, ``stream_error``), and the
``x-llmdiag-backend`` header when a gateway sets it. :class:`LoadReport`
summarises: percentiles, errors by status, goodput (requests per second that
completed with TTFT within the SLO), and how late the dispatcher was against
the schedule (on a starved CPU an open loop stops being one; the report says
so instead of hiding it).

No rich here: the command (:mod:`llmdiag.cli.bench_load`) draws progress from
the ``progress`` callback.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

__all__ = ["LoadReport", "LoadRequest", "RequestResult", "percentile", "run_load", "schedule_from_trace"]

BACKEND_HEADER = "x-llmdiag-backend"


@dataclass(frozen=True, slots=True)
class LoadRequest:
    """One request of the schedule: send at ``at`` seconds from the start."""

    at: float
    prompt_tokens: int
    output_tokens: int


@dataclass(slots=True)
class RequestResult:
    target: str
    sent_at: float
    status: str = "pending"
    ttft: float | None = None
    e2e: float | None = None
    tokens: int = 0
    gaps: list[float] = field(default_factory=list)
    backend: str | None = None
    #: Dispatch delay against the schedule (seconds late).
    lag: float = 0.0


def schedule_from_trace(arrivals: Sequence[float], inputs: Sequence[int], outputs: Sequence[int], rate: float,
                        duration: float, max_prompt_tokens: int | None = None) -> list[LoadRequest]:
    """The first ``round(rate * duration)`` requests of a trace, arrivals scaled to span ``duration``.

    Scaling the window used (not the whole trace's mean rate) makes a short run
    offer the asked rate: real traces are bursty, and their first minutes can
    run at a fraction of their mean. The trace is tiled when it is shorter.
    """
    if not (rate > 0 and duration > 0):
        raise ValueError("rate and duration must be > 0")
    n = max(1, round(rate * duration))
    m = len(arrivals)
    if m == 0:
        return []
    span_one = (arrivals[-1] - arrivals[0]) + ((arrivals[-1] - arrivals[0]) / (m - 1) if m > 1 else 1.0)
    times: list[float] = []
    for i in range(n):
        tile, j = divmod(i, m)
        times.append(tile * span_one + arrivals[j] - arrivals[0])
    # One mean gap past the last arrival closes the window, so back-to-back windows tile evenly.
    end = times[-1] + (times[-1] / (n - 1) if n > 1 and times[-1] > 0 else 1.0)
    factor = duration / end
    out = []
    for i, t in enumerate(times):
        j = i % m
        prompt = inputs[j] if max_prompt_tokens is None else min(inputs[j], max_prompt_tokens)
        out.append(LoadRequest(t * factor, max(1, prompt), max(1, outputs[j])))
    return out


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100); ``None`` for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


@dataclass
class LoadReport:
    targets: list[str]
    offered_rps: float
    duration_s: float
    slo_ttft_s: float
    results: list[RequestResult]
    wall_s: float = 0.0

    @property
    def ok(self) -> list[RequestResult]:
        return [r for r in self.results if r.status == "200"]

    def summary(self) -> dict[str, Any]:
        ok = self.ok
        ttfts = [r.ttft for r in ok if r.ttft is not None]
        e2es = [r.e2e for r in ok if r.e2e is not None]
        gaps = [g for r in ok for g in r.gaps]
        good = sum(1 for r in ok if r.ttft is not None and r.ttft <= self.slo_ttft_s)
        lags = [r.lag for r in self.results]
        statuses = Counter(r.status for r in self.results)
        backends = Counter(r.backend for r in self.results if r.backend)
        span = max(self.duration_s, 1e-9)

        def q(values: Sequence[float], p: float) -> float | None:
            v = percentile(values, p)
            return None if v is None else round(v, 6)

        return {
            "targets": self.targets,
            "offered_rps": round(self.offered_rps, 3),
            "duration_s": self.duration_s,
            "wall_s": round(self.wall_s, 3),
            "sent": len(self.results),
            "completed": len(ok),
            "errors": {k: v for k, v in sorted(statuses.items()) if k != "200"},
            "ttft_s": {"p50": q(ttfts, 50), "p90": q(ttfts, 90), "p99": q(ttfts, 99),
                       "mean": round(sum(ttfts) / len(ttfts), 6) if ttfts else None},
            "itl_s": {"p50": q(gaps, 50), "p99": q(gaps, 99)},
            "e2e_s": {"p50": q(e2es, 50), "p99": q(e2es, 99)},
            "slo_ttft_s": self.slo_ttft_s,
            "goodput_rps": round(good / span, 3),
            "goodput_ratio": round(good / len(self.results), 4) if self.results else None,
            "output_tokens_per_s": round(sum(r.tokens for r in ok) / span, 1),
            "dispatch_lag_s": {"p50": q(lags, 50), "max": q(lags, 100)},
            "backends": dict(sorted(backends.items())),
        }


def _prompt(tokens: int) -> str:
    # About one token per word for BPE tokenizers; engines that count characters see ~4x more,
    # which is why prompt_tokens is sent too.
    return "hi " * tokens


async def _model_of(session: aiohttp.ClientSession, target: str) -> str | None:
    try:
        async with session.get(f"{target}/v1/models", timeout=aiohttp.ClientTimeout(total=5)) as resp:
            if resp.status != 200:
                return None
            doc = await resp.json(content_type=None)
        model = doc["data"][0]["id"]
        return model if isinstance(model, str) else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, IndexError, TypeError):
        return None


async def _one(session: aiohttp.ClientSession, result: RequestResult, path: str, body: bytes, timeout: float,
               t0: float) -> None:
    start = time.perf_counter()
    last: float | None = None
    loop = asyncio.get_running_loop()
    try:
        # The client hangs up after ``timeout`` seconds without a token (the first one included):
        # an impatient user, as the simulator's client_timeout_s models; a long healthy stream lives on.
        async with asyncio.timeout(timeout) as deadline:
            async with session.post(result.target + path, data=body,
                                    headers={"Content-Type": "application/json", "Accept": "text/event-stream"}) as resp:
                result.backend = resp.headers.get(BACKEND_HEADER)
                if resp.status != 200:
                    await resp.read()
                    result.status = str(resp.status)
                    return
                broken = False
                async for line in resp.content:
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        break
                    if b'"error"' in payload[:20]:
                        broken = True
                        break
                    if b'"finish_reason": null' not in payload and b'"finish_reason":null' not in payload:
                        continue  # the closing chunk (finish_reason, usage) carries no token
                    now = time.perf_counter()
                    deadline.reschedule(loop.time() + timeout)
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.gaps.append(now - last)
                    last = now
                    result.tokens += 1
                result.e2e = time.perf_counter() - start
                result.status = "stream_error" if broken or result.tokens == 0 else "200"
    except asyncio.TimeoutError:
        result.status = "timeout"
    except aiohttp.ClientConnectorError:
        result.status = "connect_error"
    except (aiohttp.ClientError, OSError):
        result.status = "stream_error"


async def run_load(
    targets: Sequence[str],
    schedule: Sequence[LoadRequest],
    *,
    timeout: float = 60.0,
    pool: bool = True,
    model: str | None = None,
    chat: bool = False,
    slo_ttft_s: float = 2.0,
    duration_s: float | None = None,
    progress: Callable[[int, int], None] | None = None,
    max_connections: int = 10_000,
) -> LoadReport:
    """Replay ``schedule`` open-loop against ``targets`` (round robin); see the module docstring."""
    targets = [t.rstrip("/") for t in targets]
    if not targets:
        raise ValueError("need at least one target")
    connector = aiohttp.TCPConnector(limit=max_connections, force_close=not pool)
    results: list[RequestResult] = []
    done = 0
    total = len(schedule)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        if model is None:
            model = await _model_of(session, targets[0])
        tasks: list[asyncio.Task[None]] = []

        def finished(_: asyncio.Task[None]) -> None:
            nonlocal done
            done += 1
            if progress is not None:
                progress(done, total)

        t0 = time.perf_counter()
        for i, req in enumerate(schedule):
            delay = req.at - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            body: dict[str, Any] = {"max_tokens": req.output_tokens, "stream": True, "ignore_eos": True,
                                    "prompt_tokens": req.prompt_tokens}
            if model:
                body["model"] = model
            if chat:
                body["messages"] = [{"role": "user", "content": _prompt(req.prompt_tokens)}]
            else:
                body["prompt"] = _prompt(req.prompt_tokens)
            result = RequestResult(targets[i % len(targets)], req.at, lag=max(0.0, -delay))
            results.append(result)
            task = asyncio.create_task(_one(session, result, path, json.dumps(body).encode(), timeout, t0))
            task.add_done_callback(finished)
            tasks.append(task)
        if tasks:
            await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    span = duration_s if duration_s is not None else (schedule[-1].at if schedule else 0.0) or 1.0
    return LoadReport(list(targets), total / span if span else 0.0, span, slo_ttft_s, results, wall)

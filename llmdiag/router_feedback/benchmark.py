"""Micro-benchmark of the balancer's hot paths (``llmdiag bench balancer``).

Times every ``pick`` (and the ``on_first_token``/``on_finish`` that release
it, so the load stays steady) with ``time.perf_counter_ns``, subtracting the
timer's own cost, at several backend counts. The SPEC 10 targets: ``pick``
p50 <= 3 us, flat in the backend count (1,000 within 1.5x of 10); feedback
<= 3 us. Numbers are reported, never asserted.
"""

from __future__ import annotations

import gc
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from llmdiag.config.balancer import BalancerConfig
from llmdiag.model import Backend
from llmdiag.router_feedback.balancer import Balancer

__all__ = ["BACKEND_COUNTS", "bench_balancer"]

BACKEND_COUNTS = (10, 100, 1000)


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, int(round(q * (len(sorted_values) - 1)))))
    return sorted_values[index]


def _timer_overhead_ns(samples: int = 2000) -> int:
    clock = time.perf_counter_ns
    costs = []
    for _ in range(samples):
        t0 = clock()
        t1 = clock()
        costs.append(t1 - t0)
    costs.sort()
    return costs[len(costs) // 2]


def _fleet(n: int, models: int = 2) -> list[Backend]:
    return [
        Backend(name=f"b{i}", url=f"http://10.{i // 250}.{i % 250}.1:8000", engine="vllm", models=(f"model-{i % models}",))
        for i in range(n)
    ]


def bench_balancer(
    iterations: int = 20_000,
    backend_counts: Sequence[int] = BACKEND_COUNTS,
    config: BalancerConfig | None = None,
    progress: Callable[[str, int], None] | None = None,
) -> dict[str, Any]:
    """Run the benchmark; ``progress(task, advance)`` is called as work completes.

    Returns ``{"pick_ns": {"10": {"p50", "p99"}, ...}, "on_finish_ns": {"p50", "p99"},
    "on_first_token_ns": {...}, "iterations": N, "timer_overhead_ns": T}``.
    """
    clock_ns = time.perf_counter_ns
    overhead = _timer_overhead_ns()
    rng = random.Random(7)
    result: dict[str, Any] = {"pick_ns": {}, "iterations": iterations, "timer_overhead_ns": overhead}
    finish_costs: list[int] = []
    first_costs: list[int] = []
    gc_was_enabled = gc.isenabled()
    try:
        for n in backend_counts:
            virtual = [1000.0]
            balancer = Balancer(_fleet(n), config=config, clock=lambda: virtual[0], rng=random.Random(n))
            # Give backends distinct scores and some standing load, as in a busy fleet.
            for i, backend in enumerate(balancer.backends):
                balancer.update_signals(backend, {"requests_waiting": rng.randint(0, 20), "kv_cache_usage": rng.random()})
                for _ in range(i % 3):
                    balancer.pick(backend.models[0], 1024, exclude=())
            virtual[0] += 60.0  # past the warm-up ramps
            costs: list[int] = []
            pick = balancer.pick
            gc.disable()
            for k in range(iterations):
                model = "model-0" if k & 1 else "model-1"
                tokens = 512 + (k % 7) * 1000
                t0 = clock_ns()
                backend = pick(model, tokens)
                t1 = clock_ns()
                costs.append(t1 - t0 - overhead)
                t0 = clock_ns()
                balancer.on_first_token(backend, 0.25, prompt_tokens=tokens)
                t1 = clock_ns()
                balancer.on_finish(backend, 200, b"", None, first_token_seen=True)
                t2 = clock_ns()
                first_costs.append(t1 - t0 - overhead)
                finish_costs.append(t2 - t1 - overhead)
                if progress is not None and (k + 1) % 1000 == 0:
                    progress(f"pick x {n} backends", 1000)
                virtual[0] += 0.0005
            if gc_was_enabled:
                gc.enable()
            if progress is not None and iterations % 1000:
                progress(f"pick x {n} backends", iterations % 1000)
            costs.sort()
            result["pick_ns"][str(n)] = {"p50": max(0, _percentile(costs, 0.50)), "p99": max(0, _percentile(costs, 0.99))}
    finally:
        if gc_was_enabled:
            gc.enable()
    finish_costs.sort()
    first_costs.sort()
    result["on_finish_ns"] = {"p50": max(0, _percentile(finish_costs, 0.5)), "p99": max(0, _percentile(finish_costs, 0.99))}
    result["on_first_token_ns"] = {"p50": max(0, _percentile(first_costs, 0.5)), "p99": max(0, _percentile(first_costs, 0.99))}
    return result

"""Export PyTorch's CUDA caching-allocator stats on an engine's own /metrics.

NVML sees only what the caching allocator reserved from the driver; whether
that memory is fragmented (reserved but unusable for the next block) is
known only inside the engine process. An engine operator adds one line to
the engine's start-up code (vLLM: a plugin or sitecustomize)::

    from llmdiag.collectors.allocator_exporter import register; register()

and the engine's Prometheus endpoint (on ``prometheus_client``'s default
registry, or the one passed) gains, per CUDA device (label ``device``):

==================================================== ===================================================
``llmdiag_allocator_reserved_bytes``                 ``reserved_bytes.all.current``
``llmdiag_allocator_allocated_bytes``                ``allocated_bytes.all.current``
``llmdiag_allocator_inactive_split_bytes``           ``inactive_split_bytes.all.current`` (fragmentation)
``llmdiag_allocator_alloc_retries_total`` (counter)  ``num_alloc_retries`` (cache flush + retry after a failed cudaMalloc)
``llmdiag_allocator_ooms_total`` (counter)           ``num_ooms``
==================================================== ===================================================

The engine collector maps them to ``allocator_reserved_bytes``,
``allocator_allocated_bytes``, ``allocator_inactive_split_bytes``,
``allocator_alloc_retries_total`` and ``allocator_ooms_total``.

The stats source is injectable (``stats_source(device) -> dict``) so that the
exporter is testable without torch; the default imports torch lazily. A
failing source never breaks the engine's scrape: that scrape simply lacks
the allocator metrics (and the failure is logged once).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import REGISTRY, Collector, CollectorRegistry

__all__ = ["ALLOCATOR_METRICS", "AllocatorStatsCollector", "register", "torch_memory_stats"]

log = logging.getLogger(__name__)

StatsSource = Callable[[int], Mapping[str, Any]]

#: (metric name without prefix/suffix, memory_stats() key, is counter, help)
ALLOCATOR_METRICS: tuple[tuple[str, str, bool, str], ...] = (
    ("llmdiag_allocator_reserved_bytes", "reserved_bytes.all.current", False,
     "Bytes the CUDA caching allocator holds from the driver (torch.cuda.memory_stats reserved_bytes.all.current)"),
    ("llmdiag_allocator_allocated_bytes", "allocated_bytes.all.current", False,
     "Bytes in live tensors (allocated_bytes.all.current)"),
    ("llmdiag_allocator_inactive_split_bytes", "inactive_split_bytes.all.current", False,
     "Bytes in inactive, non-releasable split blocks: fragmentation (inactive_split_bytes.all.current)"),
    ("llmdiag_allocator_alloc_retries", "num_alloc_retries", True,
     "cudaMalloc failures that forced a cache flush and retry (num_alloc_retries)"),
    ("llmdiag_allocator_ooms", "num_ooms", True, "Out-of-memory errors raised by the allocator (num_ooms)"),
)


def torch_memory_stats(device: int) -> Mapping[str, Any]:
    """The default source: ``torch.cuda.memory_stats(device)`` (torch imported on first use)."""
    import torch  # noqa: PLC0415 - only inside an engine process that has it

    return torch.cuda.memory_stats(device)


def _torch_devices() -> list[int]:
    import torch  # noqa: PLC0415

    return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []


class AllocatorStatsCollector(Collector):
    """A ``prometheus_client`` collector reading allocator stats at scrape time."""

    def __init__(self, stats_source: StatsSource | None = None, devices: Iterable[int] | None = None) -> None:
        self._source = stats_source or torch_memory_stats
        self._devices = list(devices) if devices is not None else None
        self._warned: set[str] = set()

    def _device_list(self) -> list[int]:
        if self._devices is None:
            try:
                self._devices = _torch_devices()
            except Exception as exc:  # noqa: BLE001 - no torch / no CUDA: export nothing
                self._warn_once(f"cannot list CUDA devices: {type(exc).__name__}: {exc}")
                return []
        return self._devices

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            log.warning("llmdiag allocator exporter: %s", message)

    def describe(self) -> Iterator[Any]:
        # Describing without reading stats keeps register() cheap and lets the
        # registry check for name clashes up front.
        for name, _key, counter, help_text in ALLOCATOR_METRICS:
            family = CounterMetricFamily if counter else GaugeMetricFamily
            yield family(name, help_text, labels=["device"])

    def collect(self) -> Iterator[Any]:
        families = {
            name: (CounterMetricFamily if counter else GaugeMetricFamily)(name, help_text, labels=["device"])
            for name, _key, counter, help_text in ALLOCATOR_METRICS
        }
        for device in self._device_list():
            try:
                stats = self._source(device)
            except Exception as exc:  # noqa: BLE001 - never break the engine's own scrape
                self._warn_once(f"memory_stats({device}) failed: {type(exc).__name__}: {exc}")
                continue
            for name, key, _counter, _help in ALLOCATOR_METRICS:
                value = stats.get(key)
                # A key the torch version does not report is absent, not zero.
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    families[name].add_metric([str(device)], float(value))
        yield from (f for f in families.values() if f.samples)


def register(
    registry: CollectorRegistry | None = None,
    stats_source: StatsSource | None = None,
    devices: Iterable[int] | None = None,
) -> AllocatorStatsCollector:
    """Register the exporter on ``registry`` (default: prometheus_client's global one) and return it."""
    collector = AllocatorStatsCollector(stats_source, devices)
    (registry if registry is not None else REGISTRY).register(collector)
    return collector

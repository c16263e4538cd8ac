"""``[engine]``: how the engine metrics collector scrapes backends' ``/metrics``."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EngineConfig"]


@dataclass(frozen=True)
class EngineConfig:
    #: Whole-request deadline for one scrape (connect + headers + body), seconds.
    timeout_seconds: float = 1.0
    #: A larger /metrics answer is refused (up=0): 4 MiB is ~10x a busy vLLM scrape.
    max_response_bytes: int = 4 * 1024 * 1024
    #: Weight of the newest window mean in the latency EWMAs (ttft_seconds.ewma, ...).
    ewma_alpha: float = 0.2
    #: Threads for the backends not at an ``http://`` IP address (``https``, host names); those at
    #: one are all scraped at once from the collecting thread (collectors/http_multi.py).
    max_workers: int = 8
    #: Path of the metrics endpoint on each backend.
    metrics_path: str = "/metrics"
    #: Per-probe timeout when discovering engines on listening sockets, seconds.
    discovery_timeout_seconds: float = 0.5

    def __post_init__(self) -> None:
        if not 0 < self.timeout_seconds <= 60:
            raise ValueError(f"timeout_seconds must be in (0, 60], got {self.timeout_seconds}")
        if not 1024 <= self.max_response_bytes <= 1 << 30:
            raise ValueError(f"max_response_bytes must be 1024..1073741824, got {self.max_response_bytes}")
        if not 0 < self.ewma_alpha <= 1:
            raise ValueError(f"ewma_alpha must be in (0, 1], got {self.ewma_alpha}")
        if not 1 <= self.max_workers <= 64:
            raise ValueError(f"max_workers must be 1..64, got {self.max_workers}")
        if not self.metrics_path.startswith("/"):
            raise ValueError(f"metrics_path must start with '/', got {self.metrics_path!r}")
        if not 0 < self.discovery_timeout_seconds <= 10:
            raise ValueError(f"discovery_timeout_seconds must be in (0, 10], got {self.discovery_timeout_seconds}")

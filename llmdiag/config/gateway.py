"""``[gateway]``: the embedded OpenAI-compatible gateway (``llmdiag gateway``, SPEC 6.5).

The balancer itself is configured in ``[balancer]``; backends in ``[[backends]]``
(or ``--backend URL``). Everything here has a default, so ``llmdiag gateway
--backend http://127.0.0.1:8000`` runs with an empty file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from urllib.parse import urlsplit

__all__ = ["GatewayConfig", "split_listen"]


def split_listen(text: str) -> tuple[str, int]:
    """``"127.0.0.1:8080"`` / ``"[::1]:8080"`` / ``":8080"`` -> (host, port); raises ``ValueError``."""
    host, sep, port_text = text.rpartition(":")
    if not sep:
        raise ValueError(f"listen address {text!r} must be HOST:PORT")
    host = host.strip("[]") or "127.0.0.1"
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"listen address {text!r}: port {port_text!r} is not a number") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"listen address {text!r}: port must be 0..65535")
    return host, port


def _positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


@dataclass(frozen=True)
class GatewayConfig:
    #: Address the gateway serves on (loopback unless configured; SPEC 10).
    listen: str = "127.0.0.1:8080"
    #: Node agents' base URLs whose ``/v1/penalties`` the gateway applies (empty = none).
    agents: tuple[str, ...] = ()
    #: Bearer token sent to the agents ("" = none).
    agent_token: str = ""
    #: How often the agents are polled, and how long one poll may take.
    agent_poll_seconds: float = 1.0
    agent_timeout_seconds: float = 1.0
    #: Connecting to a backend may take this long (then: connect_error, retried elsewhere).
    connect_timeout_seconds: float = 2.0
    #: A whole request, first byte to last, may take this long (then: timeout).
    request_timeout_seconds: float = 600.0
    #: Longest silence from the backend between two reads, response headers included
    #: (a stalled engine; then: timeout, retried elsewhere if nothing was streamed yet).
    idle_timeout_seconds: float = 60.0
    #: Pooled keep-alive connections per backend (a bound: more requests wait for one).
    max_connections_per_backend: int = 512
    #: Idle client connections close after this long.
    keepalive_seconds: float = 75.0
    #: A request head must be complete this long after its first byte (then: 408; a slow-loris client).
    head_timeout_seconds: float = 10.0
    #: A request body must be complete this long after its head (then: 408; a body trickled a byte at a time).
    body_timeout_seconds: float = 60.0
    #: Open client connections at most; one more is answered 503 and closed.
    max_client_connections: int = 10_000
    #: A connection being closed whose client does not take the rest of its answer within this long is aborted.
    linger_seconds: float = 10.0
    #: Idle pooled connections to the backends close after this long: below uvicorn's 5 s
    #: keep-alive (vLLM, SGLang), so the gateway drops an idle connection before the engine
    #: does and never sends a request into one the engine is closing (the request would be
    #: lost after it was sent, and with one backend there is no other to retry on).
    upstream_keepalive_seconds: float = 4.0
    #: Largest request body accepted from a client.
    max_request_bytes: int = 16 * 1024 * 1024
    #: Prompt-token estimate for routing: characters per token.
    chars_per_token: float = 4.0
    #: Shadow backend ("" = no mirroring): a sampled fraction of requests is also sent there;
    #: its answers are read and discarded, and never reach or delay the client.
    mirror_url: str = ""
    mirror_fraction: float = 0.0
    #: Mirrored requests in flight at most (more are dropped and counted).
    mirror_max_in_flight: int = 64
    #: Active probes of each backend (SPEC 6.3: tiny completions; what re-admits an ejected backend).
    probes: bool = True
    #: ``-`` = access log on stderr, "" = none, else a file path (appended to).
    access_log: str = "-"
    #: Scrape each backend's own ``/metrics`` (queue, KV usage, TTFT) for the balancer every
    #: ``engine_signals_seconds`` ([engine] settings apply); off for engines without Prometheus metrics.
    engine_signals: bool = True
    engine_signals_seconds: float = 1.0
    #: ``/v1/models`` answers are merged across backends and cached this long.
    models_cache_seconds: float = 10.0

    def __post_init__(self) -> None:
        split_listen(self.listen)
        for url in self.agents:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"agents: {url!r} is not an http(s)://host:port URL")
        if self.mirror_url:
            parts = urlsplit(self.mirror_url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"mirror_url: {self.mirror_url!r} is not an http(s)://host:port URL")
        for name in ("agent_poll_seconds", "agent_timeout_seconds", "connect_timeout_seconds",
                     "request_timeout_seconds", "idle_timeout_seconds", "keepalive_seconds", "upstream_keepalive_seconds",
                     "head_timeout_seconds", "body_timeout_seconds", "linger_seconds",
                     "chars_per_token", "models_cache_seconds", "engine_signals_seconds"):
            _positive(name, getattr(self, name))
        for name in ("max_connections_per_backend", "max_request_bytes", "mirror_max_in_flight", "max_client_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.mirror_fraction <= 1.0:
            raise ValueError(f"mirror_fraction must be in [0, 1], got {self.mirror_fraction!r}")
        if self.mirror_fraction > 0 and not self.mirror_url:
            raise ValueError("mirror_fraction > 0 needs a mirror_url")

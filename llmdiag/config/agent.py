"""``[agent]`` and ``[[backends]]``: what the node agent runs and which engines it watches."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from llmdiag.model import ENGINES, Backend
from llmdiag.model.backend import BackendURLError, check_metrics_url

__all__ = ["AgentConfig", "BackendEntry", "split_address"]


@dataclass(frozen=True)
class AgentConfig:
    #: Seconds between collection ticks (one snapshot per tick).
    interval_seconds: float = 1.0
    #: Address the agent's HTTP endpoints bind to. Loopback unless configured (SPEC 10, security).
    listen_host: str = "127.0.0.1"
    listen_port: int = 9464
    #: Optional bearer token required on the agent's HTTP endpoints except /healthz ("" = none;
    #: prefer ``token_file`` or the LLMDIAG_AGENT_TOKEN environment variable over a token in the file).
    bearer_token: str = ""
    #: File holding the bearer token (surrounding white space ignored; "" = none).
    token_file: str = ""
    #: Host name reported in snapshots and penalties ("" = this machine's host name).
    hostname: str = ""
    #: Find engines on local listening sockets when no backends are configured.
    discover: bool = True
    #: Seconds between re-resolutions of the backends: engines that start after the agent (with
    #: discovery) and engines that restarted (a new pid) are picked up.
    discover_interval_seconds: float = 30.0
    #: Collectors to run (names as in ``llmdiag collect --collectors``); empty = all that are available.
    collectors: tuple[str, ...] = ()
    #: HAProxy agent-check listener, ``host:port`` ("" = off). Loopback unless configured.
    agent_check_listen: str = ""
    #: Seconds a checker may take to send its line (and the reply to drain) before it is dropped.
    agent_check_timeout_seconds: float = 2.0
    #: Connections served at once; more are closed at once (and counted).
    agent_check_max_connections: int = 256
    #: Longest ``agent-send`` line accepted, in bytes.
    agent_check_max_line_bytes: int = 512
    #: ``maxconn:N`` sent in every agent-check reply (0 = not sent).
    agent_check_maxconn: int = 0
    #: ``ttl_seconds`` of the penalties document: how long a gateway may trust it.
    penalties_ttl_seconds: float = 5.0
    #: /healthz answers 503 when the last tick is older than this (0 = max(5 s, 5 ticks)).
    healthz_stale_seconds: float = 0.0
    #: Recently closed diagnoses kept in /v1/state.
    keep_closed_diagnoses: int = 100
    #: Active probes of the backends (a 1-token completion; [balancer] probe_* keys): saturation
    #: answers cool a backend (agent-check ``drain``), repeated failures eject it (``down``).
    probes: bool = True
    #: Once the BPF programs are loaded, give back the memory bcc's compiler left resident
    #: (``malloc_trim`` and ``MADV_PAGEOUT`` on libLLVM/libclang code; llmdiag.bpf.memory).
    release_compiler_memory: bool = True

    def __post_init__(self) -> None:
        for key in ("interval_seconds", "discover_interval_seconds", "agent_check_timeout_seconds", "penalties_ttl_seconds"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{key} must be a finite number > 0, got {value}")
        if not (math.isfinite(self.healthz_stale_seconds) and self.healthz_stale_seconds >= 0):
            raise ValueError(f"healthz_stale_seconds must be a finite number >= 0, got {self.healthz_stale_seconds}")
        if not 0 <= self.listen_port <= 65535:
            raise ValueError(f"listen_port must be 0..65535, got {self.listen_port}")
        if self.agent_check_listen:
            split_address(self.agent_check_listen, "agent_check_listen")
        for key, low in (("agent_check_max_connections", 1), ("agent_check_max_line_bytes", 16),
                         ("agent_check_maxconn", 0), ("keep_closed_diagnoses", 0)):
            if getattr(self, key) < low:
                raise ValueError(f"{key} must be >= {low}, got {getattr(self, key)}")

    @property
    def stale_after_seconds(self) -> float:
        """Tick age after which the agent calls itself stuck (/healthz 503)."""
        return self.healthz_stale_seconds or max(5.0, 5 * self.interval_seconds)


def split_address(text: str, what: str = "address") -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> ``(host, port)``; ``ValueError`` naming ``what`` otherwise.

    The host must be given: the agent never binds a wildcard address unless it is written out."""
    host, sep, port_text = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"{what} must be host:port (port 0..65535), got {text!r}")
    return host, int(port_text)


@dataclass(frozen=True)
class BackendEntry:
    """One ``[[backends]]`` table."""

    url: str = ""
    name: str = ""
    engine: str = ""
    models: tuple[str, ...] = ()
    labels: dict[str, str] = field(default_factory=dict)
    #: Where the engine's Prometheus metrics live when not at ``url`` + ``/metrics``
    #: (a gRPC port, Triton's 8002); empty: at ``url``.
    metrics_url: str = ""

    def __post_init__(self) -> None:
        if not self.url:
            raise ValueError("a [[backends]] entry needs a url")
        if self.engine and self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.metrics_url:
            try:
                check_metrics_url(self.metrics_url)
            except BackendURLError as exc:
                raise ValueError(f"metrics_url: {exc}") from None
        self.to_backend()  # validates the URL

    def to_backend(self) -> Backend:
        return Backend.from_url(
            self.url, name=self.name or None, engine=self.engine or None, models=self.models,
            labels=dict(self.labels), metrics_url=self.metrics_url or None,
        )

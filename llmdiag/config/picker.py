"""``[picker]`` (the Envoy endpoint picker, ``llmdiag picker``) and ``[envoy]`` (the collector reading an Envoy admin API)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from urllib.parse import urlsplit

__all__ = ["EnvoyConfig", "PickerConfig", "split_listen"]


def split_listen(text: str, key: str = "listen") -> tuple[str, int]:
    """``"127.0.0.1:9002"`` / ``"[::1]:9002"`` -> (host, port); raises ``ValueError`` naming ``key``."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"{key} must be HOST:PORT, got {text!r}")
    port = int(port_text)
    if not 0 <= port <= 65535:
        raise ValueError(f"{key}: port must be 0..65535, got {port}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, port


@dataclass(frozen=True)
class PickerConfig:
    #: gRPC (ext_proc) address. Loopback unless configured (SPEC 10); 9002 is the inference gateways' EPP port.
    listen: str = "127.0.0.1:9002"
    #: PEM certificate chain and key: serve ext_proc over TLS (the Kubernetes inference gateways connect to
    #: their picker with TLS by default); both "" = plaintext gRPC.
    tls_cert_file: str = ""
    tls_key_file: str = ""
    #: HTTP address of the picker's own /metrics and /healthz ("" = none).
    metrics_listen: str = "127.0.0.1:9090"
    #: Request bodies larger than this are answered 413 by the picker (Envoy's own buffer limit applies first).
    max_body_bytes: int = 4 * 1024 * 1024
    #: Concurrent ext_proc streams (= requests in progress) the picker keeps state for; more are refused
    #: with RESOURCE_EXHAUSTED, which Envoy turns into its failure mode (500 when failure_mode_allow is false).
    max_streams: int = 10_000
    #: Request header that names the model, set by a gateway in front (the inference gateways' body-based
    #: router sets it). When present, the picker picks on the request headers, estimates the prompt from
    #: Content-Length, and skips the body message (one round trip less). "" = always read the body.
    model_header: str = "x-gateway-model-name"
    #: Prompt characters per token for the prompt-size estimate when the body gives no ``prompt_tokens``.
    chars_per_token: float = 4.0
    #: Bytes of an error response's body kept to classify it (saturation 429/503 versus a client quota).
    error_body_bytes: int = 4096
    #: ``HOST:PORT`` whose DNS addresses are backends too, re-resolved every ``discover_interval_seconds``
    #: (a Kubernetes headless Service over the InferencePool's pods); "" = only the configured backends.
    discover: str = ""
    #: Models the discovered backends serve (empty = any model).
    discover_models: tuple[str, ...] = ()
    discover_interval_seconds: float = 5.0
    #: Active probes of each backend (SPEC 6.3: a 1-token completion every ``[balancer]
    #: probe_interval_seconds``, every ``probe_ejected_interval_seconds`` while ejected): what re-admits an
    #: ejected engine before its ejection time is out, since the picker sends it no traffic meanwhile.
    probes: bool = True
    #: Node agents' base URLs whose ``/v1/penalties`` feed the balancer (``--agent URL`` replaces this list).
    agents: tuple[str, ...] = ()
    #: Bearer token sent to the agents ("" = none).
    agent_token: str = ""
    #: How often the agents are polled, and how long one poll may take.
    agent_poll_seconds: float = 1.0
    agent_timeout_seconds: float = 1.0

    def __post_init__(self) -> None:
        split_listen(self.listen, "picker.listen")
        if self.metrics_listen:
            split_listen(self.metrics_listen, "picker.metrics_listen")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("picker.tls_cert_file and picker.tls_key_file go together (both, or neither)")
        if not 1024 <= self.max_body_bytes <= 1 << 30:
            raise ValueError(f"picker.max_body_bytes must be 1024..1073741824, got {self.max_body_bytes}")
        if not 1 <= self.max_streams <= 1_000_000:
            raise ValueError(f"picker.max_streams must be 1..1000000, got {self.max_streams}")
        if self.model_header != self.model_header.lower() or " " in self.model_header:
            raise ValueError(f"picker.model_header must be a lower-case header name, got {self.model_header!r}")
        if not (math.isfinite(self.chars_per_token) and self.chars_per_token > 0):
            raise ValueError(f"picker.chars_per_token must be a finite number > 0, got {self.chars_per_token}")
        if not 0 <= self.error_body_bytes <= 1 << 20:
            raise ValueError(f"picker.error_body_bytes must be 0..1048576, got {self.error_body_bytes}")
        for url in self.agents:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"picker.agents: {url!r} is not an http(s)://host:port URL")
        if self.discover:
            split_listen(self.discover, "picker.discover")
        for name in ("agent_poll_seconds", "agent_timeout_seconds", "discover_interval_seconds"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"picker.{name} must be a finite number > 0, got {value}")


@dataclass(frozen=True)
class EnvoyConfig:
    """``[envoy]``: the gateway-side ``envoy`` collector, which reads a running Envoy's admin API."""

    #: Base URL of the Envoy admin listener, e.g. ``http://127.0.0.1:9901`` ("" = the collector is unavailable).
    admin_url: str = ""
    #: Only these upstream clusters (empty = every cluster).
    clusters: tuple[str, ...] = ()
    #: One admin read (``/clusters`` or ``/stats``) may take this long, and return at most ``max_bytes``.
    timeout_seconds: float = 1.0
    max_bytes: int = 16 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.admin_url:
            parts = urlsplit(self.admin_url)
            if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
                raise ValueError(f"envoy.admin_url must be http(s)://host:port, got {self.admin_url!r}")
        if not (math.isfinite(self.timeout_seconds) and 0 < self.timeout_seconds <= 60):
            raise ValueError(f"envoy.timeout_seconds must be in (0, 60], got {self.timeout_seconds}")
        if not 4096 <= self.max_bytes <= 1 << 30:
            raise ValueError(f"envoy.max_bytes must be 4096..1073741824, got {self.max_bytes}")

"""``[agent]`` and ``[[backends]]``: what the node agent runs and which engines it watches."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from llmdiag.model import ENGINES, Backend

__all__ = ["AgentConfig", "BackendEntry"]


@dataclass(frozen=True)
class AgentConfig:
    #: Seconds between collection ticks (one snapshot per tick).
    interval_seconds: float = 1.0
    #: Address the agent's HTTP endpoints bind to. Loopback unless configured (SPEC 10, security).
    listen_host: str = "127.0.0.1"
    listen_port: int = 9464
    #: Optional bearer token required on the agent's HTTP endpoints ("" = none).
    bearer_token: str = ""
    #: Host name reported in snapshots and penalties ("" = this machine's host name).
    hostname: str = ""
    #: Find engines on local listening sockets when no backends are configured.
    discover: bool = True
    #: Collectors to run (names as in ``llmdiag collect --collectors``); empty = all that are available.
    collectors: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not (math.isfinite(self.interval_seconds) and self.interval_seconds > 0):
            raise ValueError(f"interval_seconds must be a finite number > 0, got {self.interval_seconds}")
        if not 0 <= self.listen_port <= 65535:
            raise ValueError(f"listen_port must be 0..65535, got {self.listen_port}")


@dataclass(frozen=True)
class BackendEntry:
    """One ``[[backends]]`` table."""

    url: str = ""
    name: str = ""
    engine: str = ""
    models: tuple[str, ...] = ()
    labels: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.url:
            raise ValueError("a [[backends]] entry needs a url")
        if self.engine and self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        self.to_backend()  # validates the URL

    def to_backend(self) -> Backend:
        return Backend.from_url(
            self.url, name=self.name or None, engine=self.engine or None, models=self.models, labels=dict(self.labels)
        )

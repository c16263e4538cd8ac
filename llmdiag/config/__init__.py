"""Configuration: one TOML file, a default for every key, unknown keys rejected.

The root :class:`Config` has one field per section; each section is a frozen
dataclass in its own module beside this one, owned by the layer that uses it.
Global CLI options (``--backend URL``) override the file through
:meth:`Config.with_backends`.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmdiag.config.agent import AgentConfig, BackendEntry
from llmdiag.config.analyzers import DiagnosisConfig
from llmdiag.config.balancer import BalancerConfig
from llmdiag.config.engine import EngineConfig
from llmdiag.config.gateway import GatewayConfig
from llmdiag.config.cuda import CudaConfig
from llmdiag.config.gpu import GpuConfig, ProcConfig
from llmdiag.config.http2 import Http2Config
from llmdiag.config.loader import ConfigError, build, read_config_text, to_data, to_toml
from llmdiag.config.picker import EnvoyConfig, PickerConfig
from llmdiag.config.tcp import TcpConfig, TimewaitConfig
from llmdiag.model import Backend

__all__ = ["AgentConfig", "BackendEntry", "Config", "ConfigError", "load_config", "to_data", "to_toml"]


@dataclass(frozen=True)
class Config:
    agent: AgentConfig = field(default_factory=AgentConfig)
    balancer: BalancerConfig = field(default_factory=BalancerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    diagnosis: DiagnosisConfig = field(default_factory=DiagnosisConfig)
    gpu: GpuConfig = field(default_factory=GpuConfig)
    proc: ProcConfig = field(default_factory=ProcConfig)
    cuda: CudaConfig = field(default_factory=CudaConfig)
    tcp: TcpConfig = field(default_factory=TcpConfig)
    timewait: TimewaitConfig = field(default_factory=TimewaitConfig)
    http2: Http2Config = field(default_factory=Http2Config)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    picker: PickerConfig = field(default_factory=PickerConfig)
    envoy: EnvoyConfig = field(default_factory=EnvoyConfig)
    backends: tuple[BackendEntry, ...] = ()

    def __post_init__(self) -> None:
        names = [b.to_backend().name for b in self.backends]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate backend names: {', '.join(dupes)}")

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> Config:
        return build(cls, data)

    @classmethod
    def from_toml(cls, text: str, source: str = "<string>") -> Config:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{source}: not valid TOML: {exc}") from None
        try:
            return cls.from_data(data)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None

    def backend_list(self) -> list[Backend]:
        return [b.to_backend() for b in self.backends]

    def with_backends(self, urls: list[str]) -> Config:
        """Replace the configured backends with ``--backend URL`` values (repeatable on the CLI)."""
        if not urls:
            return self
        try:
            entries = tuple(BackendEntry(url=u) for u in urls)
        except ValueError as exc:
            raise ConfigError(f"--backend: {exc}") from None
        return dataclasses.replace(self, backends=entries)


def load_config(path: str | Path | None) -> Config:
    """Load ``path`` (or the defaults when ``None``); errors name the file and key."""
    if path is None:
        return Config()
    p = Path(path)
    return Config.from_toml(read_config_text(p), source=str(p))

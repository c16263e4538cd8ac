"""Backend: one inference endpoint (SPEC section 3.1)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

__all__ = ["ENGINES", "Backend", "BackendURLError", "check_metrics_url"]

#: Engine kinds llmdiag knows how to read. ``openai`` is any OpenAI-compatible
#: server without a known metrics dialect.
ENGINES = ("vllm", "sglang", "trtllm", "triton", "tgi", "openai")

_SCHEMES = {"http": 80, "https": 443, "grpc": None}


class BackendURLError(ValueError):
    """A backend URL that is not ``http://host:port``, ``https://host:port`` or ``grpc://host:port``."""


@dataclass(frozen=True, slots=True)
class Backend:
    """An inference endpoint.

    ``name`` is the stable key used in snapshots, penalties and exporters.
    ``url`` is ``http://host:port`` for HTTP engines and ``grpc://host:port``
    for gRPC ones (TensorRT-LLM/Triton over gRPC). ``pid`` and ``gpus`` are
    filled by discovery when the process is on this host; ``engine`` may be
    ``None`` until discovery or the first scrape has told which engine it is.
    ``metrics_url`` (optional, ``http(s)://host:port/path``) is where the
    engine's Prometheus metrics live when not at ``url`` + ``/metrics``: a gRPC
    port (Triton serves gRPC on 8001 and metrics on 8002) or a separate
    metrics port. ``None``: the metrics are at ``url``.
    """

    name: str
    url: str
    engine: str | None = None
    models: tuple[str, ...] = ()
    pid: int | None = None
    gpus: tuple[int, ...] = ()
    labels: dict[str, str] = field(default_factory=dict, compare=False, hash=False)
    metrics_url: str | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a backend needs a non-empty name")
        split_backend_url(self.url)
        if self.metrics_url is not None:
            check_metrics_url(self.metrics_url)
        if self.engine is not None and self.engine not in ENGINES:
            raise ValueError(f"backend {self.name!r}: unknown engine {self.engine!r} (known: {', '.join(ENGINES)})")

    @classmethod
    def from_url(cls, url: str, name: str | None = None, **kwargs: Any) -> Backend:
        """A backend named after its address (``10.0.0.7:8000``, ``[::1]:8201``) unless a name is given."""
        scheme, host, port = split_backend_url(url)
        return cls(name=name or _address(host, port), url=url.rstrip("/"), **kwargs)

    @property
    def scheme(self) -> str:
        return split_backend_url(self.url)[0]

    @property
    def host(self) -> str:
        return split_backend_url(self.url)[1]

    @property
    def port(self) -> int:
        return split_backend_url(self.url)[2]

    @property
    def address(self) -> str:
        """``host:port``, as exporters and the penalties document show it."""
        _, host, port = split_backend_url(self.url)
        return _address(host, port)

    def with_process(self, pid: int | None, gpus: tuple[int, ...] = ()) -> Backend:
        return replace(self, pid=pid, gpus=tuple(gpus))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "url": self.url,
            "engine": self.engine,
            "models": list(self.models),
            "pid": self.pid,
            "gpus": list(self.gpus),
            "labels": dict(self.labels),
        }
        if self.metrics_url is not None:  # only when set: older readers and recordings stay as they were
            out["metrics_url"] = self.metrics_url
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Backend:
        return cls(
            name=obj["name"],
            url=obj["url"],
            engine=obj.get("engine"),
            models=tuple(obj.get("models") or ()),
            pid=obj.get("pid"),
            gpus=tuple(obj.get("gpus") or ()),
            labels=dict(obj.get("labels") or {}),
            metrics_url=obj.get("metrics_url") or None,
        )


def _address(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets as in URLs: ``[::1]:8201``, never ``::1:8201``."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_metrics_url(url: str) -> str:
    """A ``metrics_url`` must be ``http(s)://host[:port][/path]`` (Prometheus scrapes are HTTP); raises
    :class:`BackendURLError` otherwise, and returns the URL unchanged."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - parsing the port is what validates it
    except (ValueError, AttributeError, TypeError) as exc:
        raise BackendURLError(f"bad metrics URL {url!r}: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise BackendURLError(f"bad metrics URL {url!r}: scheme must be http or https")
    if not parts.hostname:
        raise BackendURLError(f"bad metrics URL {url!r}: no host")
    if parts.fragment:
        raise BackendURLError(f"bad metrics URL {url!r}: no #fragment")
    return url


def split_backend_url(url: str) -> tuple[str, str, int]:
    """``"http://10.0.0.7:8000"`` -> ``("http", "10.0.0.7", 8000)``; raises :class:`BackendURLError`."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise BackendURLError(f"bad backend URL {url!r}: {exc}") from None
    if parts.scheme not in _SCHEMES:
        raise BackendURLError(f"bad backend URL {url!r}: scheme must be http, https or grpc")
    if not parts.hostname:
        raise BackendURLError(f"bad backend URL {url!r}: no host")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise BackendURLError(f"bad backend URL {url!r}: give only scheme://host:port")
    if port is None:
        port = _SCHEMES[parts.scheme]
        if port is None:
            raise BackendURLError(f"bad backend URL {url!r}: grpc URLs need a port")
    return parts.scheme, parts.hostname, port

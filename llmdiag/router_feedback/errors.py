"""Classification of finished responses (SPEC 6.2).

Inference engines answer 429 for two very different reasons: the engine is
saturated (KV cache exhausted, queue full: the backend's fault, counted at
full weight and followed by a cooling period), or a client's own quota ran out
(an API key, user or tenant limit: not the backend's fault, never counted
against it). The body says which; only a bounded prefix of it is searched.
"""

from __future__ import annotations

import enum
import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any

from llmdiag.config.balancer import ErrorsConfig

__all__ = ["CONNECT_ERROR", "TIMEOUT", "Classification", "ErrorClassifier", "ResponseClass", "parse_retry_after"]

#: ``status`` values for failures that produced no HTTP status at all.
TIMEOUT = "timeout"
CONNECT_ERROR = "connect_error"


class ResponseClass(str, enum.Enum):
    """The gateway feedback classes of SPEC 3.2 (``responses_total{class}``), plus ``client_error``."""

    OK = "ok"
    SATURATED = "saturated_429"  # 429 or 503 with a saturation body
    CLIENT_RATELIMIT = "client_ratelimit_429"
    SERVER_5XX = "server_5xx"
    TIMEOUT = "timeout"
    CONNECT_ERROR = "connect_error"
    CLIENT_ERROR = "client_error"  # other 4xx: the request's fault, not counted

    @property
    def counts_as_error(self) -> bool:
        return self in _BACKEND_ERRORS


_BACKEND_ERRORS = frozenset(
    {ResponseClass.SATURATED, ResponseClass.SERVER_5XX, ResponseClass.TIMEOUT, ResponseClass.CONNECT_ERROR}
)


@dataclass(frozen=True, slots=True)
class Classification:
    response_class: ResponseClass
    #: Seconds from ``Retry-After`` when present and valid, else ``None``.
    retry_after: float | None = None
    #: What decided it (the matched pattern or header), for reasons and logs.
    matched: str = ""

    @property
    def cools(self) -> bool:
        return self.response_class is ResponseClass.SATURATED


_OK = Classification(ResponseClass.OK)


def parse_retry_after(value: Any, now: float | None = None) -> float | None:
    """``Retry-After`` as seconds: delta-seconds or an HTTP date (needs ``now``); ``None`` if invalid."""
    if value is None:
        return None
    text = value.decode("latin-1", "replace") if isinstance(value, (bytes, bytearray)) else str(value)
    text = text.strip()
    if not text:
        return None
    try:
        seconds = float(text)
    except ValueError:
        if now is None:
            return None
        try:
            seconds = parsedate_to_datetime(text).timestamp() - now
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
    if not math.isfinite(seconds):
        return None
    return max(0.0, seconds)


class ErrorClassifier:
    """Turns ``(status, body, headers)`` into a :class:`Classification`.

    ``status`` is the HTTP status code, or :data:`TIMEOUT` / :data:`CONNECT_ERROR`
    for failures without one. ``body`` may be ``bytes`` or ``str`` (only the
    first ``body_prefix_bytes`` are read); ``headers`` any mapping (names are
    matched case-insensitively).
    """

    def __init__(self, cfg: ErrorsConfig) -> None:
        self._cfg = cfg
        self._prefix = cfg.body_prefix_bytes
        self._saturation = _alternation(cfg.saturation_patterns)
        self._client = _alternation(cfg.client_quota_patterns)
        self._client_headers = frozenset(h.lower() for h in cfg.client_quota_headers)

    def classify(self, status: int | str, body: bytes | str | None = None, headers: Mapping[str, Any] | None = None,
                 now: float | None = None) -> Classification:
        """``now`` (wall-clock seconds, default ``time.time()``) resolves a ``Retry-After`` HTTP date."""
        if status == 200 or (isinstance(status, int) and 200 <= status < 400):
            return _OK
        if status == TIMEOUT:
            return Classification(ResponseClass.TIMEOUT)
        if status == CONNECT_ERROR:
            return Classification(ResponseClass.CONNECT_ERROR)
        if not isinstance(status, int) or isinstance(status, bool) or not 100 <= status <= 599:
            raise ValueError(f"status must be an HTTP status code, {TIMEOUT!r} or {CONNECT_ERROR!r}, got {status!r}")
        if status not in (429, 503):
            return Classification(ResponseClass.SERVER_5XX if status >= 500 else ResponseClass.CLIENT_ERROR)

        lowered = _lower_headers(headers)
        retry_after = parse_retry_after(lowered.get("retry-after"), time.time() if now is None else now)
        text = _prefix_text(body, self._prefix)
        match = self._saturation.search(text) if self._saturation else None
        if match:
            return Classification(ResponseClass.SATURATED, retry_after, match.group(0))
        if status == 503:
            # A 503 without a saturation body is a plain server error (still honouring Retry-After).
            return Classification(ResponseClass.SERVER_5XX, retry_after)
        match = self._client.search(text) if self._client else None
        if match:
            return Classification(ResponseClass.CLIENT_RATELIMIT, retry_after, match.group(0))
        for name in self._client_headers:
            if name in lowered:
                return Classification(ResponseClass.CLIENT_RATELIMIT, retry_after, f"header {name}")
        unknown = self._cfg.unknown_429
        if unknown == "client":
            return Classification(ResponseClass.CLIENT_RATELIMIT, retry_after, "unknown 429")
        if unknown == "error":
            return Classification(ResponseClass.SERVER_5XX, retry_after, "unknown 429")
        return Classification(ResponseClass.SATURATED, retry_after, "unknown 429")


def _alternation(patterns: tuple[str, ...]) -> re.Pattern[str] | None:
    if not patterns:
        return None
    return re.compile("|".join(f"(?:{p})" for p in patterns), re.IGNORECASE)


def _lower_headers(headers: Mapping[str, Any] | None) -> dict[str, Any]:
    if not headers:
        return {}
    try:
        items = headers.items()
    except AttributeError:
        return {}
    out: dict[str, Any] = {}
    for name, value in items:
        key = name.decode("latin-1") if isinstance(name, (bytes, bytearray)) else str(name)
        out.setdefault(key.lower(), value)
    return out


def _prefix_text(body: bytes | str | None, limit: int) -> str:
    if not body:
        return ""
    if isinstance(body, (bytes, bytearray, memoryview)):
        return bytes(body[:limit]).decode("utf-8", "replace")
    return str(body)[:limit]

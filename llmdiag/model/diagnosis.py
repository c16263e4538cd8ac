"""Diagnoses, backend state and the penalties document (SPEC sections 3.3, 3.4).

A :class:`Diagnosis` names one overload cause on a backend (or on the host)
with the evidence behind it and a health penalty in 0..1. A backend's
penalty combines its open diagnoses as ``1 - prod(1 - p_i)``
(:func:`combine_penalties`): two independent 0.5 penalties give 0.75, never
more than 1.

The penalties document is what gateways read from ``GET /v1/penalties``::

    {"schema": "llmdiag.penalties/v1", "ts": 1733140000.0, "ttl_seconds": 5, "host": "gpu-node-7",
     "backends": [{"name": "vllm-0", "address": "10.0.0.7:8000", "score": 63.5, "penalty": 0.31,
       "weight_percent": 64, "state": "degraded",
       "reasons": [{"kind": "kv_cache_saturation", "severity": "warning", "penalty": 0.25, "summary": "..."}]}]}
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DIAGNOSIS_KINDS",
    "PENALTIES_SCHEMA",
    "BackendPenalty",
    "BackendState",
    "Diagnosis",
    "Evidence",
    "PenaltiesDocument",
    "Reason",
    "Severity",
    "combine_penalties",
]

PENALTIES_SCHEMA = "llmdiag.penalties/v1"

#: The diagnosis catalog (SPEC section 5).
DIAGNOSIS_KINDS = (
    "backend_down",
    "engine_stalled",
    "kv_cache_saturation",
    "queue_avalanche",
    "false_healthy",
    "client_timeout_storm",
    "timewait_exhaustion",
    "connection_churn",
    "grpc_flow_control_stall",
    "network_degradation",
    "gpu_memory_pressure",
    "gpu_fault",
    "gpu_throttling",
    "gpu_idle_with_queue",
    "io_blocking",
    "conntrack_pressure",
    "error_burst",
)

#: ``Diagnosis.backend`` for causes that belong to the host, not one backend.
HOST = "host"


class Severity(str, enum.Enum):
    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"

    @property
    def rank(self) -> int:
        return {"info": 0, "warning": 1, "critical": 2}[self.value]


class BackendState(str, enum.Enum):
    """Routing state of a backend (SPEC 3.3, 6.3)."""

    HEALTHY = "healthy"
    DEGRADED = "degraded"
    COOLING = "cooling"  # saturation 429/503 seen; no (long) requests until a deadline
    EJECTED = "ejected"  # circuit open
    HALF_OPEN = "half_open"  # circuit probing with limited traffic
    WARMING = "warming"  # new or restarted; score ramps up


def _check_unit(name: str, value: float) -> float:
    if not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
        raise ValueError(f"{name} must be in 0..1, got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class Evidence:
    """One measurement behind a diagnosis: the signal, its value, the threshold it is held
    against, and over what window.

    ``window_seconds`` is ``None`` for a value read as it is now (a gauge, a last-seen value):
    it has no window, and the JSON says ``null`` rather than a meaningless ``0``. While a
    diagnosis is held open by hysteresis the rules give the *exit* threshold here, the one
    that keeps it open, and say "holding" in the summary."""

    signal: str
    value: float | str | None
    threshold: float | str | None
    window_seconds: float | None = None

    @property
    def window_text(self) -> str:
        """How a person reads the window: ``30s``, or ``now`` for a current value."""
        return "now" if self.window_seconds is None else f"{self.window_seconds:g}s"

    def to_json(self) -> dict[str, Any]:
        value = self.value
        if isinstance(value, float) and not math.isfinite(value):
            value = None
        return {"signal": self.signal, "value": value, "threshold": self.threshold, "window_seconds": self.window_seconds}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Evidence:
        window = obj.get("window_seconds")
        return cls(obj["signal"], obj.get("value"), obj.get("threshold"), None if window is None else float(window))


@dataclass(frozen=True, slots=True)
class Diagnosis:
    """A named overload cause with evidence (SPEC 3.3)."""

    kind: str
    backend: str
    severity: Severity
    confidence: float
    since: float
    summary: str
    evidence: tuple[Evidence, ...]
    remediation: str
    penalty: float

    def __post_init__(self) -> None:
        if self.kind not in DIAGNOSIS_KINDS:
            raise ValueError(f"unknown diagnosis kind {self.kind!r}")
        if not isinstance(self.severity, Severity):
            object.__setattr__(self, "severity", Severity(self.severity))
        _check_unit("confidence", self.confidence)
        _check_unit("penalty", self.penalty)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "backend": self.backend,
            "severity": self.severity.value,
            "confidence": self.confidence,
            "since": self.since,
            "summary": self.summary,
            "evidence": [e.to_json() for e in self.evidence],
            "remediation": self.remediation,
            "penalty": self.penalty,
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Diagnosis:
        return cls(
            kind=obj["kind"],
            backend=obj["backend"],
            severity=Severity(obj["severity"]),
            confidence=float(obj["confidence"]),
            since=float(obj["since"]),
            summary=obj["summary"],
            evidence=tuple(Evidence.from_json(e) for e in obj.get("evidence", ())),
            remediation=obj.get("remediation", ""),
            penalty=float(obj["penalty"]),
        )


def combine_penalties(penalties: Iterable[float]) -> float:
    """``1 - prod(1 - p_i)``: independent penalties compound and never exceed 1."""
    keep = 1.0
    for p in penalties:
        keep *= 1.0 - _check_unit("penalty", p)
    # Rounded so that one 0.2 penalty combines to 0.2, not 0.19999999999999996, and
    # compares as such against thresholds like [diagnosis] degraded_penalty.
    return round(1.0 - keep, 9)


@dataclass(frozen=True, slots=True)
class Reason:
    kind: str
    severity: Severity
    penalty: float
    summary: str

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "severity": Severity(self.severity).value, "penalty": self.penalty, "summary": self.summary}

    @classmethod
    def from_diagnosis(cls, d: Diagnosis) -> Reason:
        return cls(d.kind, d.severity, d.penalty, d.summary)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Reason:
        return cls(obj["kind"], Severity(obj["severity"]), float(obj["penalty"]), obj.get("summary", ""))


@dataclass(frozen=True, slots=True)
class BackendPenalty:
    """One backend's entry in the penalties document."""

    name: str
    address: str
    score: float
    penalty: float
    weight_percent: int
    state: BackendState
    reasons: tuple[Reason, ...] = ()
    #: The backend's Kubernetes labels (pod, namespace, container, node) when known.
    #: Serialised only when non-empty, so documents without them stay as they were.
    labels: Mapping[str, str] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        _check_unit("penalty", self.penalty)
        if not 0 <= self.score <= 100:
            raise ValueError(f"score must be in 0..100, got {self.score!r}")
        if not (isinstance(self.weight_percent, int) and 0 <= self.weight_percent <= 100):
            # HAProxy agent-check weights are integer percentages.
            raise ValueError(f"weight_percent must be an integer 0..100, got {self.weight_percent!r}")

    def to_json(self) -> dict[str, Any]:
        out = {
            "name": self.name,
            "address": self.address,
            "score": self.score,
            "penalty": self.penalty,
            "weight_percent": self.weight_percent,
            "state": BackendState(self.state).value,
            "reasons": [r.to_json() for r in self.reasons],
        }
        if self.labels:
            out["labels"] = dict(sorted(self.labels.items()))
        return out

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> BackendPenalty:
        return cls(
            name=obj["name"],
            address=obj["address"],
            score=float(obj["score"]),
            penalty=float(obj["penalty"]),
            weight_percent=int(obj["weight_percent"]),
            state=BackendState(obj["state"]),
            reasons=tuple(Reason.from_json(r) for r in obj.get("reasons", ())),
            labels={str(k): str(v) for k, v in (obj.get("labels") or {}).items()},
        )


@dataclass(frozen=True, slots=True)
class PenaltiesDocument:
    """``llmdiag.penalties/v1``: what the node agent tells gateways."""

    ts: float
    host: str
    ttl_seconds: float = 5
    backends: tuple[BackendPenalty, ...] = field(default_factory=tuple)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": PENALTIES_SCHEMA,
            "ts": self.ts,
            "ttl_seconds": self.ttl_seconds,
            "host": self.host,
            "backends": [b.to_json() for b in self.backends],
        }

    def dumps(self, **kwargs: Any) -> str:
        return json.dumps(self.to_json(), allow_nan=False, **kwargs)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> PenaltiesDocument:
        if obj.get("schema") != PENALTIES_SCHEMA:
            raise ValueError(f"unknown penalties schema {obj.get('schema')!r} (want {PENALTIES_SCHEMA})")
        return cls(
            ts=float(obj["ts"]),
            host=obj.get("host", ""),
            ttl_seconds=obj.get("ttl_seconds", 5),
            backends=tuple(BackendPenalty.from_json(b) for b in obj.get("backends", ())),
        )

    def is_fresh(self, now: float) -> bool:
        return now - self.ts <= self.ttl_seconds

"""Per-backend penalty, state and reasons from open diagnoses (SPEC 3.3).

The penalties document itself is built in :mod:`llmdiag.exporters.penalties`.

``penalty = 1 - prod(1 - p_i)`` over the backend's open diagnoses whose
penalty is *enforced* (a kind with ``enforce = false`` is reported, never
charged). The analyzer layer knows two states: ``degraded`` when the
combined penalty reaches ``degraded_penalty``, else ``healthy``; cooling,
ejection and warm-up belong to the balancer (llmdiag.router_feedback).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from llmdiag.model import (
    HOST,
    BackendState,
    Diagnosis,
    Reason,
    combine_penalties,
)

__all__ = ["BackendHealth", "backend_health"]


@dataclass(frozen=True, slots=True)
class BackendHealth:
    penalty: float
    state: BackendState
    reasons: tuple[Reason, ...] = ()

    def to_json(self) -> dict[str, object]:
        return {"penalty": round(self.penalty, 6), "state": self.state.value}


def backend_health(
    backends: Iterable[str],
    diagnoses: Iterable[Diagnosis],
    enforced: Mapping[str, bool],
    degraded_penalty: float,
) -> dict[str, BackendHealth]:
    """Combine each backend's enforced open diagnoses into its penalty, state and reasons."""
    by_backend: dict[str, list[Diagnosis]] = {b: [] for b in backends if b != HOST}
    for d in diagnoses:
        if d.backend != HOST and enforced.get(d.kind, True):
            by_backend.setdefault(d.backend, []).append(d)
    out = {}
    for name, ds in sorted(by_backend.items()):
        ds.sort(key=lambda d: (-d.penalty, d.kind))
        penalty = combine_penalties(d.penalty for d in ds)
        state = BackendState.DEGRADED if ds and penalty >= degraded_penalty else BackendState.HEALTHY
        out[name] = BackendHealth(penalty, state, tuple(Reason.from_diagnosis(d) for d in ds))
    return out


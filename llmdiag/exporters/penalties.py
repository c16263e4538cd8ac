"""The one builder of the ``llmdiag.penalties/v1`` document (SPEC 3.4).

Two sources feed it: the balancer's per-backend view
(:meth:`llmdiag.router_feedback.balancer.Balancer.snapshot_states`, which
knows cooling, ejection, the warm-up ramp and the adaptive weights) and the
analyzers' per-backend health (penalty, analyzer state, reasons). A backend
the balancer knows is reported as the balancer sees it; one it does not know
(a replayed recording names backends nobody configured) gets the plain
default ``score = 100 * (1 - penalty)``, ``weight_percent = round(score)``
and the analyzer's own state. Each entry carries the backend's Kubernetes
labels (pod, namespace, container, node) when the caller knows them
(``labels``, from :attr:`llmdiag.model.Backend.labels`); an entry without
labels serialises exactly as before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from llmdiag.analyzers import BackendHealth
from llmdiag.model import BackendPenalty, PenaltiesDocument

__all__ = ["backend_entries", "penalties_document"]


def backend_entries(
    health: Mapping[str, BackendHealth],
    addresses: Mapping[str, str] | None = None,
    balancer_states: Iterable[BackendPenalty] = (),
    labels: Mapping[str, Mapping[str, str]] | None = None,
) -> tuple[BackendPenalty, ...]:
    """One entry per backend named by either source, sorted by name, with its ``labels[name]`` if any."""
    addresses = addresses or {}
    labels = labels or {}
    entries = {s.name: s for s in balancer_states}
    for name, h in health.items():
        if name in entries:
            continue
        score = round(100.0 * (1.0 - h.penalty), 3)
        entries[name] = BackendPenalty(
            name=name,
            address=addresses.get(name, name),
            score=score,
            penalty=round(h.penalty, 6),
            weight_percent=int(round(score)),
            state=h.state,
            reasons=h.reasons,
        )
    return tuple(_labelled(entries[name], labels.get(name)) for name in sorted(entries))


def _labelled(entry: BackendPenalty, labels: Mapping[str, str] | None) -> BackendPenalty:
    if not labels or entry.labels == labels:
        return entry
    return dataclasses.replace(entry, labels=dict(labels))


def penalties_document(
    ts: float,
    host: str,
    health: Mapping[str, BackendHealth] | None = None,
    addresses: Mapping[str, str] | None = None,
    ttl_seconds: float = 5,
    balancer_states: Iterable[BackendPenalty] = (),
    labels: Mapping[str, Mapping[str, str]] | None = None,
) -> PenaltiesDocument:
    """``llmdiag.penalties/v1`` from analyzer health and/or the balancer's states (see the module doc)."""
    return PenaltiesDocument(
        ts=ts, host=host, ttl_seconds=ttl_seconds,
        backends=backend_entries(health or {}, addresses, balancer_states, labels),
    )

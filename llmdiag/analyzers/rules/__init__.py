"""The diagnosis rules, one class per kind of the SPEC section 5 catalog (see docs/diagnoses.md)."""

from __future__ import annotations

from llmdiag.analyzers.rules.availability import BackendDown, EngineStalled
from llmdiag.analyzers.rules.base import Finding, Rule, Verdict
from llmdiag.analyzers.rules.engine import ErrorBurst, FalseHealthy, KvCacheSaturation, QueueAvalanche
from llmdiag.analyzers.rules.gpu import GpuFault, GpuIdleWithQueue, GpuMemoryPressure, GpuThrottling, IoBlocking
from llmdiag.analyzers.rules.network import (
    ClientTimeoutStorm,
    ConnectionChurn,
    ConntrackPressure,
    GrpcFlowControlStall,
    NetworkDegradation,
    TimewaitExhaustion,
)

__all__ = ["RULES", "Finding", "Rule", "Verdict"]

#: kind -> rule class, in catalog order.
RULES: dict[str, type[Rule]] = {
    r.kind: r
    for r in (
        BackendDown,
        EngineStalled,
        KvCacheSaturation,
        QueueAvalanche,
        FalseHealthy,
        ClientTimeoutStorm,
        TimewaitExhaustion,
        ConnectionChurn,
        GrpcFlowControlStall,
        NetworkDegradation,
        GpuMemoryPressure,
        GpuFault,
        GpuThrottling,
        GpuIdleWithQueue,
        IoBlocking,
        ConntrackPressure,
        ErrorBurst,
    )
}

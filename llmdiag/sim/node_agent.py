"""The node agent in the simulator: the real analyzers on snapshots of what an agent would collect.

Each tick (``tick_s``, 1 s like the agent) builds one
:class:`~llmdiag.model.Snapshot` from the simulated engines, as the real
collectors would fill it on the GPU hosts, and runs the real
:class:`~llmdiag.analyzers.Analyzer` (the diagnosis catalog at the
``[diagnosis]`` configuration given, default :class:`DiagnosisConfig`) over it.
The penalties and reasons it returns per backend are what the simulator
delivers to the balancer ``penalty_delay_s`` later (the agent publishes, the
gateway pulls). Nothing here decides a penalty: thresholds, hysteresis,
severities and penalties are the product's own (issue 14 point 4).

What goes into the snapshot (only what a real agent sees on the node):

- engine ``/metrics``: ``up`` (0 while the process is down: nothing answers the
  scrape, ``scrape_failure{reason="connection_refused"}``), ``kv_cache_usage``, ``requests_waiting``, ``requests_running``,
  ``preemptions_total`` and ``ttft_seconds`` (an EWMA of the engine's first
  token times, as the engine collector derives it from the histogram);
- NVML, one GPU per engine (``Backend.gpus``): ``gpu_utilization`` (1 while
  the engine has running requests) and ``throttle_reasons`` (thermal slowdown
  while a ``slowdown`` fault is on);
- BPF: ``tcp_peer_closes_total``, the clients that hung up on the engine.

Not seen: the gateway's status codes, client quotas, 5xx bodies.
"""

from __future__ import annotations

from collections.abc import Sequence

from llmdiag.analyzers.analyzer import Analyzer
from llmdiag.config.analyzers import DiagnosisConfig
from llmdiag.model import Backend, Distribution, Labelled, Reason, Snapshot
from llmdiag.sim.engine_model import EngineModel

__all__ = ["NodeAgentModel"]

#: EWMA weight of each first token in the engine's ``ttft_seconds`` (the engine collector's alpha).
TTFT_ALPHA = 0.2
_THROTTLED = Labelled({"reason=sw_thermal_slowdown": 1.0})
_NOT_THROTTLED = Labelled({})
_REFUSED = Labelled({"reason=connection_refused": 1.0})


class NodeAgentModel:
    """Runs the real analyzer over the simulated engines; ``tick`` returns the penalties that changed."""

    def __init__(
        self,
        engines: Sequence[EngineModel],
        tick_s: float = 1.0,
        config: DiagnosisConfig | None = None,
        names: Sequence[str] | None = None,
    ) -> None:
        self.engines = engines
        self.tick_s = tick_s
        self.names = list(names) if names is not None else [e.name or f"engine-{i}" for i, e in enumerate(engines)]
        backends = [
            Backend(name=name, url=f"http://10.0.{i // 250}.{i % 250 + 1}:8000", engine="vllm", gpus=(str(i),))
            for i, name in enumerate(self.names)
        ]
        self.analyzer = Analyzer(config or DiagnosisConfig(), backends=backends)
        n = len(engines)
        self._cancels = [0] * n
        self._ttft: list[float | None] = [None] * n
        self.last: list[tuple[float, tuple[Reason, ...]]] = [(0.0, ())] * n

    def client_cancel(self, i: int, now: float) -> None:
        """A client hung up on engine ``i`` (its TCP peer close is what BPF counts)."""
        self._cancels[i] += 1

    def first_token(self, i: int, ttft: float) -> None:
        """Engine ``i`` produced a first token ``ttft`` seconds after the request arrived."""
        old = self._ttft[i]
        self._ttft[i] = ttft if old is None else TTFT_ALPHA * ttft + (1.0 - TTFT_ALPHA) * old

    def snapshot(self, now: float) -> Snapshot:
        """What the agent's collectors would put in one snapshot at ``now``."""
        backends = {}
        gpus = {}
        for i, (name, eng) in enumerate(zip(self.names, self.engines)):
            if eng.down:
                # What the engine collector reports for a port nothing listens on.
                backends[name] = {"up": 0.0, "scrape_failure": _REFUSED, "tcp_peer_closes_total": float(self._cancels[i])}
                gpus[str(i)] = {"gpu_utilization": 0.0, "throttle_reasons": _NOT_THROTTLED}
                continue
            running = len(eng.running)
            signals = {
                "up": 1.0,
                "kv_cache_usage": eng.kv_usage,
                "requests_waiting": float(eng.num_waiting),
                "requests_running": float(running),
                "preemptions_total": float(eng.preemptions_total),
                "tcp_peer_closes_total": float(self._cancels[i]),
            }
            if self._ttft[i] is not None:
                signals["ttft_seconds"] = Distribution(ewma=self._ttft[i])
            backends[name] = signals
            busy = 1.0 if running else 0.0
            gpus[str(i)] = {
                "gpu_utilization": busy,
                "throttle_reasons": _THROTTLED if eng.slowdown > 1.0 else _NOT_THROTTLED,
            }
        return Snapshot(ts=now, hostname="sim", backends=backends, gpus=gpus)

    def tick(self, now: float) -> list[tuple[int, float, tuple[Reason, ...]]]:
        """Observe one snapshot; return ``(engine, penalty, reasons)`` for the backends whose penalty changed."""
        result = self.analyzer.observe(self.snapshot(now))
        changed: list[tuple[int, float, tuple[Reason, ...]]] = []
        for i, name in enumerate(self.names):
            health = result.backends.get(name)
            current = (round(health.penalty, 6), health.reasons) if health is not None else (0.0, ())
            if current != self.last[i]:
                self.last[i] = current
                changed.append((i, current[0], current[1]))
        return changed

"""A model of the llmdiag node agent for the simulator: what it could see on a
GPU host, turned into penalties with hysteresis.

It reads only what a real agent reads on the node: GPU throttling (NVML
throttle reasons while busy), the engine's ``/metrics`` (KV usage, waiting
queue, preemptions) and client cancellations (RST_STREAM/peer closes seen by
BPF). It does not see the gateway's status codes, client quotas, crashes of
the process (that is the gateway's connect errors) or 5xx bodies.

Rules follow the diagnosis catalog (SPEC 5) at their default thresholds:

=====================  ==============================================================  =======
kind                   opens when (evaluated each ``tick_s``)                          penalty
=====================  ==============================================================  =======
gpu_throttling         slowdown active while the engine has running requests           0.30
kv_cache_saturation    KV usage >= 0.85 for 3 s, or preemptions rose since last tick   0.25
queue_avalanche        waiting >= 30, or waiting rising 3 ticks in a row and >= 5      0.40
client_timeout_storm   >= 3 client cancels in the last 5 s                              0.30
=====================  ==============================================================  =======

A diagnosis closes ``hold_s`` (5 s) after its condition last held, so it does
not flap. The penalty ``1 - prod(1 - p_i)`` is what the simulator delivers to
the balancer ``delay_s`` later (the agent publishes, the gateway pulls).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from llmdiag.model import Reason, Severity
from llmdiag.sim.engine_model import EngineModel

__all__ = ["NodeAgentModel", "RULE_PENALTIES"]

RULE_PENALTIES = {
    "gpu_throttling": 0.30,
    "kv_cache_saturation": 0.25,
    "queue_avalanche": 0.40,
    "client_timeout_storm": 0.30,
}


class _EngineWatch:
    __slots__ = ("kv_high_since", "last_preemptions", "waiting_hist", "cancels", "open_until")

    def __init__(self) -> None:
        self.kv_high_since: float | None = None
        self.last_preemptions = 0
        self.waiting_hist: deque[int] = deque(maxlen=4)
        self.cancels: deque[float] = deque()
        self.open_until: dict[str, float] = {}


class NodeAgentModel:
    def __init__(self, engines: Sequence[EngineModel], tick_s: float = 1.0, hold_s: float = 5.0) -> None:
        self.engines = engines
        self.tick_s = tick_s
        self.hold_s = hold_s
        self._watch = [_EngineWatch() for _ in engines]
        self.last: list[float] = [0.0] * len(engines)

    def client_cancel(self, i: int, now: float) -> None:
        self._watch[i].cancels.append(now)

    def tick(self, now: float) -> list[tuple[int, float, tuple[Reason, ...]]]:
        """Evaluate every engine; return ``(engine, penalty, reasons)`` for those whose penalty changed."""
        changed: list[tuple[int, float, tuple[Reason, ...]]] = []
        for i, (eng, w) in enumerate(zip(self.engines, self._watch)):
            firing: dict[str, str] = {}
            if not eng.down:
                if eng.slowdown > 1.0 and eng.running:
                    firing["gpu_throttling"] = f"GPU throttled: clocks at {1 / eng.slowdown:.0%} while busy"
                kv = eng.kv_usage
                if kv >= 0.85:
                    if w.kv_high_since is None:
                        w.kv_high_since = now
                else:
                    w.kv_high_since = None
                preempted = eng.preemptions_total > w.last_preemptions
                w.last_preemptions = eng.preemptions_total
                if preempted or (w.kv_high_since is not None and now - w.kv_high_since >= 3.0):
                    firing["kv_cache_saturation"] = f"KV cache {kv:.0%} used" + (", preempting" if preempted else "")
                waiting = eng.num_waiting
                w.waiting_hist.append(waiting)
                hist = w.waiting_hist
                rising = len(hist) == hist.maxlen and all(b > a for a, b in zip(hist, list(hist)[1:]))
                if waiting >= 30 or (rising and waiting >= 5):
                    firing["queue_avalanche"] = f"{waiting} requests waiting" + (" and rising" if rising else "")
            else:
                w.waiting_hist.clear()
                w.kv_high_since = None
            while w.cancels and w.cancels[0] < now - 5.0:
                w.cancels.popleft()
            if len(w.cancels) >= 3:
                firing["client_timeout_storm"] = f"{len(w.cancels)} client cancels in 5 s"
            for kind in firing:
                w.open_until[kind] = now + self.hold_s
            reasons = []
            keep = 1.0
            for kind, until in sorted(w.open_until.items()):
                if until <= now:
                    continue
                p = RULE_PENALTIES[kind]
                keep *= 1.0 - p
                reasons.append(Reason(kind, Severity.WARNING, p, firing.get(kind, "holding")))
            w.open_until = {k: u for k, u in w.open_until.items() if u > now}
            penalty = round(1.0 - keep, 6)
            if penalty != self.last[i]:
                self.last[i] = penalty
                changed.append((i, penalty, tuple(reasons)))
        return changed

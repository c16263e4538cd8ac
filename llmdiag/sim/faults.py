"""Fault schedules for the engine model (SPEC section 8).

A schedule is a list of timed faults. The driver asks for the transition times
(:meth:`FaultSchedule.transitions`) and, at each, calls
:meth:`FaultSchedule.apply`, which recomputes the engine's fault state from
every fault active at that instant (so overlapping faults compose and applying
twice changes nothing).

Kinds:

- ``slowdown`` (``speed`` 0..1): thermal/power throttling; step time is divided by ``speed``;
- ``stall``: the engine makes no progress until the fault ends (a hung NCCL call, a GC pause);
- ``crash`` (``down`` seconds): the process dies, in-flight requests are lost,
  connections are refused; it restarts after ``down`` seconds with a cold
  warm-up (``warmup_s``, ``warmup_factor``);
- ``error_5xx`` (``ratio``): that share of new requests is answered 500;
- ``kv_shrink`` (``factor``): the usable KV cache drops to ``factor`` of nominal
  (another process took GPU memory, fragmentation).

Text form (for ``llmdiag fake-engine --faults``): faults separated by ``;``,
each ``kind:key=value,...`` with ``start`` (s) and ``duration`` (s, omitted =
until the end), e.g. ``slowdown:start=120,speed=0.4;crash:start=300,down=20``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from llmdiag.sim.engine_model import EngineModel, SimRequest

__all__ = ["FAULT_KINDS", "Fault", "FaultSchedule", "parse_faults"]

FAULT_KINDS = ("slowdown", "stall", "crash", "error_5xx", "kv_shrink")


@dataclass(frozen=True, slots=True)
class Fault:
    kind: str
    start: float
    duration: float = math.inf
    speed: float = 1.0  # slowdown
    ratio: float = 0.0  # error_5xx
    factor: float = 1.0  # kv_shrink
    warmup_s: float = 30.0  # crash: cold warm-up after the restart
    warmup_factor: float = 3.0

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r} (known: {', '.join(FAULT_KINDS)})")
        if not self.start >= 0 or not self.duration > 0:
            raise ValueError(f"fault {self.kind}: start must be >= 0 and duration > 0")
        if not 0 < self.speed <= 1:
            raise ValueError(f"fault {self.kind}: speed must be in (0, 1], got {self.speed}")
        if not 0 <= self.ratio <= 1:
            raise ValueError(f"fault {self.kind}: ratio must be in [0, 1], got {self.ratio}")
        if not 0 < self.factor <= 1:
            raise ValueError(f"fault {self.kind}: factor must be in (0, 1], got {self.factor}")
        if self.kind == "crash" and math.isinf(self.duration):
            raise ValueError("fault crash: give its down time (down=S or duration=S)")
        if self.warmup_s < 0 or self.warmup_factor < 1:
            raise ValueError("fault crash: warmup_s must be >= 0 and warmup_factor >= 1")

    @property
    def end(self) -> float:
        return self.start + self.duration

    def active(self, t: float) -> bool:
        return self.start <= t < self.end


@dataclass(frozen=True)
class FaultSchedule:
    faults: tuple[Fault, ...] = field(default_factory=tuple)

    def transitions(self) -> list[float]:
        """Instants at which the fault state changes, sorted."""
        times = {f.start for f in self.faults} | {f.end for f in self.faults if math.isfinite(f.end)}
        return sorted(times)

    def apply(self, engine: EngineModel, t: float) -> list[SimRequest]:
        """Set ``engine``'s fault state to what the schedule says at ``t``.

        Returns the requests lost if the engine crashed at ``t``.
        """
        active = [f for f in self.faults if f.active(t)]
        slowdown = 1.0
        stall_until = 0.0
        ratio = 0.0
        kv_factor = 1.0
        crash: Fault | None = None
        for f in active:
            if f.kind == "slowdown":
                slowdown /= f.speed
            elif f.kind == "stall":
                stall_until = max(stall_until, f.end)
            elif f.kind == "error_5xx":
                ratio = max(ratio, f.ratio)
            elif f.kind == "kv_shrink":
                kv_factor = min(kv_factor, f.factor)
            elif f.kind == "crash":
                crash = f
        engine.slowdown = slowdown
        engine.stall_until = stall_until
        engine.error_ratio = ratio
        engine.set_kv_capacity_factor(kv_factor)
        lost: list[SimRequest] = []
        if crash is not None and not engine.down:
            lost = engine.crash(t)
        elif crash is None and engine.down:
            ended = [f for f in self.faults if f.kind == "crash" and f.end <= t]
            last = max(ended, key=lambda f: f.end) if ended else None
            engine.restart(
                t,
                warmup_s=last.warmup_s if last else 30.0,
                warmup_factor=last.warmup_factor if last else 3.0,
            )
        return lost


_FLOAT_KEYS = {"start", "duration", "speed", "ratio", "factor", "warmup_s", "warmup_factor"}


def parse_faults(spec: str) -> FaultSchedule:
    """Parse the text form (module docstring). Raises ValueError naming the bad part."""
    faults: list[Fault] = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        kind, _, rest = part.partition(":")
        kwargs: dict[str, float] = {}
        for item in filter(None, (i.strip() for i in rest.split(","))):
            key, eq, value = item.partition("=")
            key = key.strip()
            if not eq:
                raise ValueError(f"fault {part!r}: expected key=value, got {item!r}")
            if key == "down":
                key = "duration"
            if key not in _FLOAT_KEYS:
                raise ValueError(f"fault {part!r}: unknown key {key!r}")
            try:
                kwargs[key] = float(value)
            except ValueError:
                raise ValueError(f"fault {part!r}: {key} is not a number: {value!r}") from None
        kwargs.setdefault("start", 0.0)
        faults.append(Fault(kind.strip(), **kwargs))
    return FaultSchedule(tuple(faults))

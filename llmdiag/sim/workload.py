"""Workloads for the cluster simulator: real traces, time-scaled to a target
utilisation of the cluster's measured capacity.

A trace is any CSV with the columns ``arrival_s,input_tokens,output_tokens``
(arrival in seconds, any origin; rows need not be sorted). Named traces are the
files in ``../shared/data/traces/``: ``azure2023_conv``, ``azure2023_code``,
``mooncake_synthetic``; ``sharegpt_poisson`` and ``sharegpt_gamma`` take the
ShareGPT length pairs (no timestamps) and draw Poisson or Gamma (CV 2, bursty)
arrivals at 1 req/s before scaling.

Scaling: ``scale_to_rate`` stretches or compresses the inter-arrival times so
the mean rate equals the target, and tiles the trace (each copy shifted by the
trace span) when a duration longer than one pass is asked for. The target rate
is ``utilization x capacity``, capacity being measured by saturating each engine
(:func:`llmdiag.sim.cluster.measure_capacity`).
"""

from __future__ import annotations

import csv
import os
import random
from dataclasses import dataclass
from pathlib import Path

__all__ = ["NAMED_TRACES", "Trace", "TraceError", "load_trace", "scale_to_rate", "shared_data_dir"]

NAMED_TRACES = ("azure2023_conv", "azure2023_code", "mooncake_synthetic", "sharegpt_poisson", "sharegpt_gamma")
_SHAREGPT = "sharegpt_8k_filtered_stats_llama2_tokenizer.csv"


class TraceError(ValueError):
    """A trace that cannot be read: missing file, wrong columns, bad numbers."""


@dataclass(frozen=True)
class Trace:
    """Requests as three parallel tuples, sorted by arrival, first arrival at 0."""

    name: str
    arrivals: tuple[float, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.arrivals)

    @property
    def span(self) -> float:
        """Seconds from the first to the last arrival plus one mean gap (so tiles do not collide)."""
        if len(self.arrivals) < 2:
            return 1.0
        last = self.arrivals[-1]
        return last + last / (len(self.arrivals) - 1)

    @property
    def mean_rate(self) -> float:
        return len(self.arrivals) / self.span


def shared_data_dir() -> Path:
    """Where the named traces live: ``$LLMDIAG_DATA_DIR``, else ``../shared/data`` next to the checkout."""
    override = os.environ.get("LLMDIAG_DATA_DIR")
    if override:
        return Path(override)
    return Path(__file__).resolve().parents[2].parent / "shared" / "data"


def load_trace(name_or_path: str, *, seed: int = 0, data_dir: Path | None = None) -> Trace:
    """A named trace (module docstring) or a CSV path."""
    data_dir = data_dir or shared_data_dir()
    if name_or_path in ("sharegpt_poisson", "sharegpt_gamma"):
        return _sharegpt(name_or_path, data_dir / "traces" / _SHAREGPT, seed)
    path = Path(name_or_path)
    if name_or_path in NAMED_TRACES:
        path = data_dir / "traces" / f"{name_or_path}.csv"
    elif not path.exists() and (data_dir / "traces" / f"{name_or_path}.csv").exists():
        path = data_dir / "traces" / f"{name_or_path}.csv"
    if not path.is_file():
        raise TraceError(
            f"trace {name_or_path!r}: no such file (named traces: {', '.join(NAMED_TRACES)}, looked for in "
            f"{data_dir / 'traces'}, which LLMDIAG_DATA_DIR overrides; or a CSV with arrival_s,input_tokens,output_tokens)"
        )
    rows: list[tuple[float, int, int]] = []
    try:
        with path.open(newline="") as fh:
            reader = csv.DictReader(fh)
            cols = set(reader.fieldnames or ())
            missing = {"arrival_s", "input_tokens", "output_tokens"} - cols
            if missing:
                raise TraceError(f"trace {path}: missing column(s) {', '.join(sorted(missing))}")
            for lineno, row in enumerate(reader, start=2):
                try:
                    arrival = float(row["arrival_s"])
                    n_in = int(float(row["input_tokens"]))
                    n_out = int(float(row["output_tokens"]))
                except (TypeError, ValueError):
                    raise TraceError(f"trace {path}:{lineno}: not a number in {row!r}") from None
                if arrival != arrival or n_in < 0 or n_out < 0:
                    raise TraceError(f"trace {path}:{lineno}: negative or NaN value in {row!r}")
                rows.append((arrival, max(1, n_in), max(1, n_out)))
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"trace {path}: {exc}") from None
    if not rows:
        raise TraceError(f"trace {path}: no requests")
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    return Trace(
        path.stem,
        tuple(r[0] - t0 for r in rows),
        tuple(r[1] for r in rows),
        tuple(r[2] for r in rows),
    )


def _sharegpt(name: str, path: Path, seed: int) -> Trace:
    if not path.is_file():
        raise TraceError(f"trace {name}: {path} not found")
    inputs: list[int] = []
    outputs: list[int] = []
    with path.open(newline="") as fh:
        for row in csv.DictReader(fh):
            inputs.append(max(1, int(float(row["num_prefill_tokens"]))))
            outputs.append(max(1, int(float(row["num_decode_tokens"]))))
    rng = random.Random(seed)
    order = list(range(len(inputs)))
    rng.shuffle(order)
    arrivals: list[float] = []
    t = 0.0
    # Gamma with shape k and scale 1/k has mean 1 and CV 1/sqrt(k): k = 0.25 gives CV 2.
    shape = 0.25 if name == "sharegpt_gamma" else 1.0
    for _ in order:
        arrivals.append(t)
        t += rng.gammavariate(shape, 1.0 / shape) if shape != 1.0 else rng.expovariate(1.0)
    return Trace(name, tuple(arrivals), tuple(inputs[i] for i in order), tuple(outputs[i] for i in order))


def scale_to_rate(trace: Trace, rate: float, duration: float | None = None) -> Trace:
    """Time-scale ``trace`` to a mean of ``rate`` requests per second.

    With ``duration``, keep arrivals before it, tiling the trace when one pass
    is shorter. Without, one full pass.
    """
    if not rate > 0:
        raise ValueError(f"target rate must be > 0, got {rate}")
    factor = trace.mean_rate / rate
    span = trace.span * factor
    base = [a * factor for a in trace.arrivals]
    if duration is None:
        return Trace(trace.name, tuple(base), trace.inputs, trace.outputs)
    arrivals: list[float] = []
    inputs: list[int] = []
    outputs: list[int] = []
    offset = 0.0
    n = len(base)
    while offset < duration:
        for i in range(n):
            t = base[i] + offset
            if t >= duration:
                break
            arrivals.append(t)
            inputs.append(trace.inputs[i])
            outputs.append(trace.outputs[i])
        offset += span
    return Trace(trace.name, tuple(arrivals), tuple(inputs), tuple(outputs))

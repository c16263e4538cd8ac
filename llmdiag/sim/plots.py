"""PNG plots of simulator runs (matplotlib, Agg backend, imported lazily)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["plot_scenario"]


def plot_scenario(result: Any, out_dir: Path) -> list[Path]:
    """Write ``<scenario>_ttft.png`` (the TTFT CDF of every policy) and
    ``<scenario>_<policy>_load.png`` (waiting queue per engine over time).
    Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    names = list(result.results)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in names:
        points = result.results[name].ttft_quantiles
        if points:
            ax.plot([t for _, t in points], [q for q, _ in points], linewidth=1.2, label=name)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.axhline(0.99, color="grey", linewidth=0.6, linestyle=":")
    ax.grid(True, which="both", linewidth=0.3)
    ax.set_title(f"TTFT CDF: {result.scenario} / {result.trace} at {result.utilization:.0%}, {result.instances} engines")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / f"{result.scenario}_ttft.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    for name in names:
        series = result.results[name].series
        t = series.get("t") or []
        if not t:
            continue
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 5), sharex=True)
        for i, waiting in enumerate(series["waiting"]):
            ax1.plot(t, waiting, linewidth=0.8, label=f"engine-{i}")
        for i, kv in enumerate(series["kv_usage"]):
            ax2.plot(t, kv, linewidth=0.8)
        ax1.set_ylabel("waiting requests")
        ax2.set_ylabel("KV usage")
        ax2.set_xlabel("virtual time (s)")
        ax1.set_title(f"{result.scenario}: {name}")
        if len(series["waiting"]) <= 16:
            ax1.legend(fontsize=6, ncol=4)
        fig.tight_layout()
        path = out_dir / f"{result.scenario}_{name}_load.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written

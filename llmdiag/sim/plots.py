"""PNG plots of simulator runs (matplotlib, Agg backend, imported lazily)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["plot_scenario"]


def plot_scenario(result: Any, out_dir: Path) -> list[Path]:
    """Write ``<scenario>_ttft.png`` (P50/P99 TTFT per policy) and
    ``<scenario>_<policy>_load.png`` (waiting queue per engine over time).
    Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    names = list(result.results)
    p50 = [result.results[n].ttft_p50 or 0.0 for n in names]
    p99 = [result.results[n].ttft_p99 or 0.0 for n in names]
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(names)), 4))
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], p50, width=0.4, label="TTFT p50")
    ax.bar([i + 0.2 for i in x], p99, width=0.4, label="TTFT p99")
    ax.set_xticks(list(x))
    ax.set_xticklabels(names, rotation=30, ha="right")
    ax.set_ylabel("seconds")
    ax.set_yscale("log")
    ax.set_title(f"{result.scenario} / {result.trace} at {result.utilization:.0%} of capacity, {result.instances} engines")
    ax.legend()
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

#!/usr/bin/env python3
"""Fit the simulator's step-time model ``t = t0 + a*P + b*D + c*sum_ctx`` to the
calibration data in ../shared/data/calibration/ and report residuals.

    .venv/bin/python bench/fit_step_model.py [--data DIR] [--json]

Sources and how each becomes (P, D, sum_ctx, t) observations:

- splitwise_perf_model.csv (Llama2-70B, BLOOM-176B on A100/H100, TP 2/4/8):
  ``prompt_time`` is a prefill of ``batch_size x prompt_size`` tokens (P, D=0);
  ``token_time`` is one decode iteration of ``batch_size`` sequences whose
  context averages ``prompt_size + token_size/2`` (D, sum_ctx). Repeats are
  reduced to their median.
- sarathi_osdi_figure-2_{decode,prefill}.csv (Yi-34B, 2xA100): decode batch
  sizes 1..128 and prefill lengths; context of the decode points is not in the
  file (the paper used short contexts), so c is not identifiable there and is fixed at 0.
- vidur_linear_ops_summary.csv: the non-attention (linear) ops only, a lower
  bound on a step; used to check the 8B presets (a preset below the bound
  would be too fast), not to fit them.

The fit is least squares on relative error (each row weighted by 1/t, so a
10 ms step counts as much as a 1 s one), with non-negative coefficients (a
coefficient that comes out negative is fixed at 0 and the rest refitted).
Pure Python: four unknowns, normal equations.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmdiag.sim.engine_model import PRESETS  # noqa: E402

Obs = tuple[float, float, float, float]  # P, D, sum_ctx, t (seconds)
NAMES = ("t0", "a", "b", "c")


def _solve(m: list[list[float]], v: list[float]) -> list[float]:
    n = len(v)
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[piv][col]) < 1e-300:
            raise ValueError("singular system")
        a[col], a[piv] = a[piv], a[col]
        for r in range(n):
            if r != col:
                f = a[r][col] / a[col][col]
                for k in range(col, n + 1):
                    a[r][k] -= f * a[col][k]
    return [a[i][n] / a[i][i] for i in range(n)]


def fit(obs: list[Obs], free: tuple[bool, bool, bool, bool] = (True, True, True, True)) -> list[float]:
    """Non-negative weighted least squares for (t0, a, b, c)."""
    free = list(free)
    while True:
        idx = [i for i in range(4) if free[i]]
        m = [[0.0] * len(idx) for _ in idx]
        v = [0.0] * len(idx)
        for p, d, ctx, t in obs:
            x = (1.0, p, d, ctx)
            w = 1.0 / (t * t)
            for r, i in enumerate(idx):
                v[r] += w * x[i] * t
                for s, j in enumerate(idx):
                    m[r][s] += w * x[i] * x[j]
        sol = _solve(m, v)
        coef = [0.0] * 4
        for r, i in enumerate(idx):
            coef[i] = sol[r]
        neg = [i for i in idx if coef[i] < 0]
        if not neg:
            return coef
        free[min(neg, key=lambda i: coef[i])] = False


def residuals(coef: list[float], obs: list[Obs]) -> dict[str, float]:
    rel = []
    for p, d, ctx, t in obs:
        pred = coef[0] + coef[1] * p + coef[2] * d + coef[3] * ctx
        rel.append((pred - t) / t)
    rel_abs = [abs(r) for r in rel]
    return {
        "n": len(obs),
        "median_abs_rel_err": statistics.median(rel_abs),
        "max_abs_rel_err": max(rel_abs),
        "mean_rel_err": statistics.fmean(rel),
    }


def splitwise(path: Path) -> dict[str, list[Obs]]:
    groups: dict[tuple[str, str, str, int, int, int], list[tuple[float, float]]] = defaultdict(list)
    with path.open(newline="") as fh:
        for row in csv.DictReader(fh):
            key = (row["model"], row["hardware"], row["tensor_parallel"],
                   int(row["prompt_size"]), int(row["batch_size"]), int(row["token_size"]))
            groups[key].append((float(row["prompt_time"]), float(row["token_time"])))
    out: dict[str, list[Obs]] = defaultdict(list)
    for (model, hw, tp, prompt, batch, tokens), times in groups.items():
        name = f"{model}/{hw}/tp{tp}"
        prefill_ms = statistics.median(t[0] for t in times)
        decode_ms = statistics.median(t[1] for t in times)
        out[name].append((float(batch * prompt), 0.0, 0.0, prefill_ms / 1000.0))
        out[name].append((0.0, float(batch), batch * (prompt + tokens / 2.0), decode_ms / 1000.0))
    return out


def sarathi(data: Path) -> list[Obs]:
    obs: list[Obs] = []
    with (data / "sarathi_osdi_figure-2_decode.csv").open(newline="") as fh:
        for row in csv.DictReader(fh):
            obs.append((0.0, float(row["batch_size"]), 0.0, float(row["batch_execution_time"])))
    with (data / "sarathi_osdi_figure-2_prefill.csv").open(newline="") as fh:
        for row in csv.DictReader(fh):
            obs.append((float(row["batch_num_prefill_tokens"]), 0.0, 0.0, float(row["batch_execution_time"])))
    return obs


def vidur_bounds(path: Path) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = defaultdict(list)
    with path.open(newline="") as fh:
        for row in csv.DictReader(fh):
            if row["model"] == "meta-llama/Meta-Llama-3-8B" and row["tp"] == "1":
                out[row["gpu"]].append((int(row["num_tokens"]), float(row["model_linear_ms"]) / 1000.0))
    return out


PRESET_SOURCE = {
    "llama-70b-h100-tp4": "llama2-70b/h100-80gb/tp4",
    "llama-70b-a100-tp8": "llama2-70b/a100-80gb/tp8",
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "data" / "calibration")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not args.data.is_dir():
        print(f"fit_step_model: {args.data} not found", file=sys.stderr)
        return 2
    report: dict[str, dict] = {"fits": {}, "presets": {}, "vidur_lower_bound": {}}
    groups = splitwise(args.data / "splitwise_perf_model.csv")
    for name in sorted(groups):
        coef = fit(groups[name])
        report["fits"][name] = {"coef": dict(zip(NAMES, coef)), **residuals(coef, groups[name])}
    sar = sarathi(args.data)
    coef = fit(sar, (True, True, True, False))
    report["fits"]["yi-34b/a100/tp2 (sarathi)"] = {"coef": dict(zip(NAMES, coef)), **residuals(coef, sar)}
    for preset, source in PRESET_SOURCE.items():
        st = PRESETS[preset].step
        coef = [st.t0, st.a, st.b, st.c]
        report["presets"][preset] = {"against": source, **residuals(coef, groups[source])}
    for gpu, points in sorted(vidur_bounds(args.data / "vidur_linear_ops_summary.csv").items()):
        preset = PRESETS.get(f"llama3-8b-{gpu}")
        if preset is None:
            continue
        st = preset.step
        # A pure-prefill step of n tokens must not be faster than its linear ops.
        ratios = [(st.t0 + st.a * n) / t for n, t in points if n >= 1]
        report["vidur_lower_bound"][preset.name] = {
            "points": len(points),
            "min_preset_over_bound": min(ratios),
            "median_preset_over_bound": statistics.median(ratios),
        }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print("| data set | t0 (ms) | a (us/prefill tok) | b (us/decode seq) | c (us/ctx tok) | n | median abs rel err | max abs rel err |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in report["fits"].items():
        c = r["coef"]
        print(f"| {name} | {c['t0']*1e3:.1f} | {c['a']*1e6:.1f} | {c['b']*1e6:.1f} | {c['c']*1e6:.4f} | {r['n']} "
              f"| {r['median_abs_rel_err']:.1%} | {r['max_abs_rel_err']:.1%} |")
    print()
    print("| preset | evaluated against | median abs rel err | max abs rel err | mean rel err (bias) |")
    print("|---|---|---|---|---|")
    for name, r in report["presets"].items():
        print(f"| {name} | {r['against']} | {r['median_abs_rel_err']:.1%} | {r['max_abs_rel_err']:.1%} | {r['mean_rel_err']:+.1%} |")
    print()
    print("| preset | vidur linear-op points | min preset/bound | median preset/bound |")
    print("|---|---|---|---|")
    for name, r in report["vidur_lower_bound"].items():
        print(f"| {name} | {r['points']} | {r['min_preset_over_bound']:.2f} | {r['median_preset_over_bound']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

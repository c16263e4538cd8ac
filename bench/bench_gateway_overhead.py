"""What ``llmdiag gateway`` adds to TTFT, next to HAProxy in the same run, and its streaming req/s ceiling.

    .venv/bin/python bench/bench_gateway_overhead.py                 # ~1 min
    .venv/bin/python bench/bench_gateway_overhead.py --rounds 100 --seconds 5 --out /tmp/gw
    git archive <commit> llmdiag | tar -x -C /tmp/before             # a before/after in one run:
    .venv/bin/python bench/bench_gateway_overhead.py --compare-repo /tmp/before

Part 1, added TTFT: two fake engines (``llama3-8b-h100``), ``llmdiag gateway``
(one per ``--loops`` event loop, plus the gateway of ``--compare-repo``'s
checkout) and HAProxy 2.6 (roundrobin, keep-alive to the servers) in front of
them, each its own process. Each round sends one streamed completion (32 prompt tokens, 2
output tokens) direct to an engine (alternating), through the gateway and
through HAProxy, in a shuffled order, one at a time, so nothing queues and the
only difference is the hop. TTFT is the time to the first streamed token at the
client. Added latency = percentile through the proxy - percentile direct.

Part 2, streaming req/s: an upstream that streams 8 tokens instantly (so the
proxy, not the engine model, is what is measured), and a closed loop of
``--concurrency`` clients for ``--seconds`` per path: completed streams per
second direct, through the gateway and through HAProxy. The client is Python
too and shares the machine's cores with everything else: read the ratio, not
the absolute number.

Writes ``<out>.json`` and ``<out>.png`` (TTFT CDFs of part 1).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gateway_common import MODEL, Fleet, free_port  # noqa: E402


async def _ttft(session: aiohttp.ClientSession, url: str) -> float:
    body = {"model": MODEL, "prompt": "hi " * 32, "prompt_tokens": 32, "max_tokens": 2, "stream": True}
    start = time.perf_counter()
    first = None
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, resp.status
        async for line in resp.content:
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter() - start
    assert first is not None
    return first


async def added_ttft(paths: dict[str, list[str]], rounds: int, seed: int) -> dict[str, list[float]]:
    rng = random.Random(seed)
    out: dict[str, list[float]] = {k: [] for k in paths}
    async with aiohttp.ClientSession() as session:
        for name, urls in paths.items():  # warm every connection pool first
            for u in urls:
                for _ in range(3):
                    await _ttft(session, u)
        for i in range(rounds):
            order = list(paths)
            rng.shuffle(order)
            for name in order:
                urls = paths[name]
                out[name].append(await _ttft(session, urls[i % len(urls)]))
    return out


async def throughput(url: str, concurrency: int, seconds: float) -> dict[str, float]:
    done = 0
    errors = 0
    stop_at = time.perf_counter() + seconds
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 8, "stream": True}).encode()
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def client() -> None:
            nonlocal done, errors
            while time.perf_counter() < stop_at:
                try:
                    async with session.post(url + "/v1/completions", data=body,
                                            headers={"Content-Type": "application/json"}) as resp:
                        await resp.read()
                        if resp.status == 200:
                            done += 1
                        else:
                            errors += 1
                except aiohttp.ClientError:
                    errors += 1

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return {"streams_per_s": round(done / elapsed, 1), "errors": errors}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q / 100 * len(ordered) + 0.5)) - 1))]


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--loops", default="uvloop,asyncio" if _importable("uvloop") else "asyncio",
                        help="gateway event loops to measure, one gateway each (default: uvloop,asyncio)")
    parser.add_argument("--compare-repo", metavar="PATH", type=Path,
                        help="also run the gateway of another checkout (e.g. the main branch) in the same run: a before/after")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "gateway_overhead"))
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    loops = [x for x in args.loops.split(",") if x]
    result: dict = {"python": platform.python_version(), "rounds": args.rounds, "loops": loops,
                    "compare_repo": str(args.compare_repo) if args.compare_repo else None}

    def gateways(fleet: Fleet, upstreams: list[str], extra_toml: str = "") -> dict[str, str]:
        out = {f"gateway_{loop}": fleet.gateway(free_port(), upstreams, extra_toml=extra_toml, loop=loop) for loop in loops}
        if args.compare_repo:
            out["gateway_before"] = fleet.gateway(free_port(), upstreams, extra_toml=extra_toml, repo=args.compare_repo)
        return out

    with Fleet() as fleet:
        engines = [fleet.engine(free_port(), label=str(i)) for i in range(2)]
        paths = {"direct": engines}
        paths.update({name: [url] for name, url in gateways(fleet, engines).items()})
        paths["haproxy"] = [fleet.haproxy(free_port(), engines)]
        print(f"part 1: {args.rounds} rounds of {' / '.join(paths)} ...", flush=True)
        ttfts = asyncio.run(added_ttft(paths, args.rounds, args.seed))
        stats = {}
        for name, values in ttfts.items():
            stats[name] = {"p50_ms": round(pct(values, 50) * 1000, 3), "p99_ms": round(pct(values, 99) * 1000, 3),
                           "mean_ms": round(statistics.fmean(values) * 1000, 3)}
        for name in paths:
            if name == "direct":
                continue
            stats[name]["added_p50_ms"] = round(stats[name]["p50_ms"] - stats["direct"]["p50_ms"], 3)
            stats[name]["added_p99_ms"] = round(stats[name]["p99_ms"] - stats["direct"]["p99_ms"], 3)
            # Paired by round: each round's proxy TTFT minus the same round's direct TTFT.
            diffs = [a - b for a, b in zip(ttfts[name], ttfts["direct"])]
            stats[name]["paired_added_p50_ms"] = round(pct(diffs, 50) * 1000, 3)
        result["ttft"] = stats
        result["ttft_samples_ms"] = {k: [round(v * 1000, 3) for v in vals] for k, vals in ttfts.items()}
        fleet.close()
    with Fleet() as fleet:
        upstream = fleet.instant_upstream(free_port())
        targets = {"direct": upstream, **gateways(fleet, [upstream], "probes = false\nengine_signals = false"),
                   "haproxy": fleet.haproxy(free_port(), [upstream])}
        tp = {}
        for name, url in targets.items():
            print(f"part 2: {name}, {args.concurrency} clients for {args.seconds:g} s ...", flush=True)
            tp[name] = asyncio.run(throughput(url, args.concurrency, args.seconds))
        result["throughput"] = tp
    result["loadavg_after"] = list(os.getloadavg())
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"ttft": result["ttft"], "throughput": result["throughput"], "loadavg_after": result["loadavg_after"]},
                     indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, values in ttfts.items():
        xs = sorted(v * 1000 for v in values)
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=f"{name} (p50 {stats[name]['p50_ms']:.2f} ms)")
    ax.set_xlabel("TTFT at the client (ms), 2 fake engines, one request at a time")
    ax.set_ylabel("CDF")
    ax.set_title("llmdiag gateway vs HAProxy vs direct")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main()

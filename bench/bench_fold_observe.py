"""The agent's work after its collectors, on recorded samples: the snapshot fold and ``AgentLoop.observe``.

    PYTHONPATH=. .venv/bin/python bench/bench_fold_observe.py record --ticks 60 --out /tmp/fleet16.pickle   # as root, ~1.5 min
    PYTHONPATH=. .venv/bin/python bench/bench_fold_observe.py replay /tmp/fleet16.pickle --passes 3 --digest /tmp/out.txt

``record`` starts 16 fake engines (``tests/integration/agent_support.fake_engines``) with a light
load (4 requests/s in all), builds the agent's collectors as ``llmdiag agent`` does, and keeps one
tick a second of every collector's samples (as plain tuples, so a recording outlives changes to
:class:`~llmdiag.model.Sample`) and status, after 5 warm-up ticks.

``replay`` folds each tick's samples into a :class:`~llmdiag.model.Snapshot` in the collectors'
order (``Snapshot.extend``, as the ticker does) and hands it to a fresh :class:`AgentLoop` per pass,
timing both with ``time.thread_time`` (CPU of this thread only, so fairly robust to other load on
the machine) over all but the first 10 ticks of each pass. The samples are built before the timing.
``--digest FILE`` writes, per tick of the first pass, the snapshot, the diagnoses opened, closed and
open, the backends' health, ``/v1/penalties`` and ``/v1/state`` (less ``last_tick_seconds``) as JSON
lines: two checkouts that analyse the same way write the same file.

To compare two checkouts, run ``replay`` alternately with ``PYTHONPATH`` pointing at each (best of
a few rounds; report the load average next to the figures).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import pickle
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any


def record(ticks: int, out: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))
    from agent_support import fake_engines  # type: ignore[import-not-found]

    from llmdiag.agent.daemon import Agent
    from llmdiag.agent.wiring import build_collectors
    from llmdiag.config import load_config
    from llmdiag.sim.demo_fleet import run_load

    with fake_engines([[] for _ in range(16)]) as urls:
        stop = threading.Event()

        def load() -> None:
            async def go() -> None:
                done = asyncio.Event()
                asyncio.get_running_loop().run_in_executor(None, lambda: (stop.wait(), done.set()))
                await run_load(urls, "fake/llama3-8b", 4.0, 3600, client_timeout_s=30, stop=done)
            asyncio.run(go())

        config = load_config(None).with_backends(urls)
        collectors, unavailable = build_collectors(config, Agent(config).backends)
        threading.Thread(target=load, daemon=True).start()
        kept = []
        try:
            for i in range(ticks + 5):
                now = time.time()
                per = [(c.name, [(s.scope.value, s.subject, s.name, s.value, s.engine) for s in c.collect(now)], c.status())
                       for c in collectors]
                if i >= 5:
                    kept.append((now, per, dict(unavailable)))
                time.sleep(1)
        finally:
            stop.set()
            for c in collectors:
                c.close()
    with open(out, "wb") as fh:
        pickle.dump({"urls": list(urls), "ticks": kept}, fh)
    print(f"recorded {len(kept)} ticks, {sum(len(s) for _, s, _ in kept[-1][1])} samples in the last one -> {out}")


def replay(path: Path, passes: int, digest: Path | None) -> dict[str, Any]:
    from llmdiag.agent.daemon import Agent
    from llmdiag.agent.loop import AgentLoop
    from llmdiag.config import load_config
    from llmdiag.model import Sample, Scope, Snapshot

    with open(path, "rb") as fh:
        data = pickle.load(fh)  # noqa: S301 - a file this script wrote
    config = load_config(None).with_backends(data["urls"])
    ticks = [(now, [(name, [Sample(Scope(a), b, c, d, e) for a, b, c, d, e in samples], status)
                    for name, samples, status in per], unavailable)
             for now, per, unavailable in data["ticks"]]
    fold: list[float] = []
    observe: list[float] = []
    lines: list[str] = []
    for run in range(passes):
        loop = AgentLoop(config, Agent(config).backends)
        for i, (now, per, unavailable) in enumerate(ticks):
            started = time.thread_time()
            snap = Snapshot(ts=now, hostname="h")
            for name, samples, status in per:
                snap.extend(samples)
                snap.collectors[name] = status
            snap.collectors.update(unavailable)
            folded = time.thread_time()
            state = loop.observe(snap, 0.01)
            done = time.thread_time()
            if i >= 10:
                fold.append(folded - started)
                observe.append(done - folded)
            if run == 0 and digest is not None:
                result = loop.last_result
                assert result is not None
                lines.append(json.dumps({
                    "snapshot": snap.to_json(),
                    "opened": [d.to_json() for d in result.opened],
                    "closed": [d.to_json() for d in result.closed],
                    "open": [d.to_json() for d in result.open],
                    "health": {n: [h.penalty, h.state.value, [r.to_json() for r in h.reasons]]
                               for n, h in sorted(result.backends.items())},
                    "penalties": state.penalties(5).to_json(),
                    "state": {k: v for k, v in state.to_json().items() if k != "last_tick_seconds"},
                }, sort_keys=True))
    out = {
        "fold_ms": round(1000 * statistics.mean(fold), 3),
        "observe_ms": round(1000 * statistics.mean(observe), 3),
        "both_ms": round(1000 * (statistics.mean(fold) + statistics.mean(observe)), 3),
        "ticks_timed": len(fold),
        "load_average": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }
    if digest is not None:
        text = "\n".join(lines)
        digest.write_text(text)
        out["digest_sha256"] = hashlib.sha256(text.encode()).hexdigest()[:16]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="record the collectors' samples of 16 fake engines (as root)")
    rec.add_argument("--ticks", type=int, default=60)
    rec.add_argument("--out", type=Path, required=True)
    rep = sub.add_parser("replay", help="fold and observe a recording; thread CPU per tick")
    rep.add_argument("recording", type=Path)
    rep.add_argument("--passes", type=int, default=3)
    rep.add_argument("--digest", type=Path, help="write every tick's output here (first pass)")
    args = ap.parse_args()
    if args.cmd == "record":
        if args.ticks < 11:
            ap.error("--ticks must be at least 11 (the first 10 of each replay pass are not timed)")
        record(args.ticks, args.out)
    else:
        try:
            print(json.dumps(replay(args.recording, max(1, args.passes), args.digest)))
        except (OSError, pickle.UnpicklingError, KeyError, EOFError) as exc:
            sys.exit(f"cannot replay {args.recording}: {type(exc).__name__}: {exc}")


if __name__ == "__main__":
    main()

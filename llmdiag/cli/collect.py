"""``llmdiag collect``: run collectors and print or record snapshots.

    llmdiag collect --once --json                      one snapshot as JSON
    llmdiag collect --duration 30 --record run.jsonl.gz
    llmdiag collect --collectors tcp,timewait --backend http://127.0.0.1:8000 --json

Snapshots follow ``llmdiag.snapshot/v1`` (SPEC 3.2). Without ``--json`` each
snapshot is shown per backend, grouped by source, every value with its unit;
``--json`` prints one JSON document per line (JSONL); ``--record FILE`` writes the same lines to a
file (gzip when it ends in ``.gz``) for ``llmdiag diagnose --replay``.
Counters become rates and histograms become window quantiles only from the
second tick on, so ``--once`` primes the collectors, waits one interval and
prints the second snapshot.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from llmdiag.agent import wiring
from llmdiag.agent.wiring import BuildProgress
from llmdiag.agent.ticker import snapshot_ticks
from llmdiag.cli.main import EX_USAGE, name_list, positive_seconds
from llmdiag.cli.progress import CollectorProgress
from llmdiag.cli.snapshot_view import print_snapshot
from llmdiag.config import Config
from llmdiag.model import Snapshot, write_snapshots


def snapshot_stream(
    config: Config,
    names: list[str] | None,
    *,
    duration: float | None,
    once: bool,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
    progress: BuildProgress | None = None,
) -> Iterator[Snapshot]:
    """Yield snapshots at ``[agent] interval_seconds`` for ``duration`` seconds (or forever)."""
    backends = wiring.resolve_backends(config)
    return snapshot_ticks(config, backends, names, duration=1 if once else duration, prime=once, clock=clock, sleep=sleep,
                          progress=progress)


def _started(stream: Iterator[Snapshot]) -> Iterator[Snapshot]:
    """Pull the first snapshot now (the collectors start then), and give the stream back whole."""
    first = next(stream, None)

    def whole() -> Iterator[Snapshot]:
        if first is not None:
            yield first
            yield from stream  # and closing this closes the ticker (collectors detached)

    return whole()


def handle(args: argparse.Namespace, config: Config) -> int:
    if args.interval is not None:
        config = dataclasses.replace(config, agent=dataclasses.replace(config.agent, interval_seconds=args.interval))
    if args.nvml_replay:
        config = dataclasses.replace(config, gpu=dataclasses.replace(config.gpu, replay_file=args.nvml_replay))
    names = args.collectors  # None = all; never empty (name_list)
    try:
        # A spinner per collector on a terminal while they start (BPF compiles take seconds).
        with CollectorProgress() as progress:
            stream = _started(snapshot_stream(config, names, duration=args.duration, once=args.once, progress=progress))
        if args.record:
            count = write_snapshots(args.record, _echo(stream, args.json))
            print(f"recorded {count} snapshot(s) to {args.record}", file=sys.stderr)
            return 0
        for snap in stream:
            if args.json:
                print(snap.dumps(), flush=True)
            else:
                print_snapshot(snap)
    except ValueError as exc:
        print(f"llmdiag: {exc}", file=sys.stderr)
        return EX_USAGE
    except BrokenPipeError:
        raise  # stdout's reader went away (`| head -1`): main() ends quietly
    except OSError as exc:
        print(f"llmdiag: cannot write {args.record}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    return 0


def _echo(stream: Iterator[Snapshot], as_json: bool) -> Iterator[Snapshot]:
    for snap in stream:
        if as_json:
            print(snap.dumps(), flush=True)
        else:
            print(f"{time.strftime('%H:%M:%S', time.localtime(snap.ts))} snapshot: "
                  f"{len(snap.backends)} backend(s), {len(snap.gpus)} GPU(s), "
                  f"collectors {_statuses(snap)}", file=sys.stderr, flush=True)
        yield snap


def _statuses(snap: Snapshot) -> str:
    return ", ".join(f"{n}={s.status.value}" for n, s in sorted(snap.collectors.items())) or "none"


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "collect",
        help="run collectors and print or record snapshots (llmdiag.snapshot/v1)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    when = parser.add_mutually_exclusive_group()
    when.add_argument("--once", action="store_true", help="print one snapshot (after one priming interval) and exit")
    when.add_argument("--duration", type=positive_seconds, metavar="S", help="collect for S seconds (default: until Ctrl-C)")
    parser.add_argument("--collectors", type=name_list, metavar="A,B", help="collectors to run (default: all available)")
    parser.add_argument("--interval", type=positive_seconds, metavar="S", help="seconds between snapshots (default: [agent] interval_seconds)")
    parser.add_argument("--nvml-replay", metavar="FILE", help="drive the gpu collector from a recorded NVML replay file")
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print each snapshot as one JSON line")
    out.add_argument("--record", metavar="FILE", help="write snapshots as JSONL (gzip if FILE ends in .gz)")
    parser.set_defaults(handler=handle)

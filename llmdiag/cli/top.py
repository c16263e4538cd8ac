"""``llmdiag top [--agent URL | --replay FILE | --demo]``: the interactive diagnosis TUI.

With no option it watches this host: the same collectors, analyzers and
scoring balancer as ``llmdiag diagnose`` and the agent, in-process, once per
``[agent] interval_seconds``. ``--replay FILE`` plays a recording from
``llmdiag collect --record FILE`` (or ``llmdiag demo --record FILE``) with
pause, step, speed and "jump to the next diagnosis". ``--agent URL`` watches
a running ``llmdiag agent`` through its ``GET /v1/state`` (``--token`` for a
bearer token, or ``LLMDIAG_TOKEN``). ``--demo`` starts the
demo fleet (fake vLLM engines on 127.0.0.1 with scripted faults; see
``llmdiag demo``) and watches it; everything it started stops when you quit.

Keys: ``?`` in the app. Colours only repeat what the text says; ``NO_COLOR=1``
gives a monochrome UI.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from llmdiag.agent.sources import AgentSource, LiveSource, ReplaySource, StateSource
from llmdiag.cli.main import EX_USAGE, positive_seconds
from llmdiag.config import Config
from llmdiag.model import SnapshotError

__all__ = ["build_source", "register"]


def build_source(args: argparse.Namespace, config: Config) -> StateSource:
    """The source the options ask for (raises OSError/SnapshotError/ValueError with a message)."""
    if args.agent:
        return AgentSource(args.agent, token=args.token or os.environ.get("LLMDIAG_TOKEN"))
    if args.replay:
        return ReplaySource.from_file(config, args.replay, speed=args.speed, paused=args.paused)
    if args.demo:
        from llmdiag.cli.tui.demo_source import demo_source  # noqa: PLC0415 - sim only when asked

        return demo_source(config, duration=args.duration)
    from llmdiag.agent.ticker import snapshot_ticks  # noqa: PLC0415
    from llmdiag.agent.wiring import resolve_backends  # noqa: PLC0415

    backends = resolve_backends(config)
    names = ", ".join(b.name for b in backends) or "no engines found"
    return LiveSource(config, backends, lambda sleep: snapshot_ticks(config, backends, duration=args.duration, sleep=sleep),
                      description=f"live on this host ({names})")


def handle(args: argparse.Namespace, config: Config) -> int:
    try:
        source = build_source(args, config)
    except (OSError, SnapshotError) as exc:
        print(f"llmdiag top: cannot replay {args.replay}: {exc}", file=sys.stderr)
        return 3
    except ValueError as exc:
        print(f"llmdiag top: {exc}", file=sys.stderr)
        return EX_USAGE
    from llmdiag.cli.tui.app import TopApp  # noqa: PLC0415 - textual only for this command

    app = TopApp(source)
    try:
        app.run()
    finally:
        source.close()
    return 0


def register(sub: Any) -> None:
    parser = sub.add_parser("top", help="interactive TUI: which backend is drowning, why, and what routing does",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--agent", metavar="URL", help="watch a running llmdiag agent (http://host:port)")
    what.add_argument("--replay", metavar="FILE", help="play a recording (llmdiag collect/demo --record FILE)")
    what.add_argument("--demo", action="store_true", help="start the demo fleet of fake engines and watch it")
    parser.add_argument("--speed", type=positive_seconds, default=1.0, metavar="X",
                        help="replay speed, 0.25..64 (default 1: real time)")
    parser.add_argument("--paused", action="store_true", help="start a replay paused (n steps, space plays)")
    parser.add_argument("--token", metavar="TOKEN", help="bearer token for --agent (default: $LLMDIAG_TOKEN)")
    parser.add_argument("--duration", type=positive_seconds, default=None, metavar="S",
                        help="stop reading after S seconds (live and demo; default: until you quit)")
    parser.set_defaults(handler=handle)

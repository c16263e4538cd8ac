"""``llmdiag gateway``: an OpenAI-compatible streaming gateway that routes with the scoring balancer.

    llmdiag --backend http://10.0.0.7:8000 --backend http://10.0.0.8:8000 gateway \\
        --listen 0.0.0.0:8080 --agent http://10.0.0.7:9464 --agent http://10.0.0.8:9464

Serves POST /v1/chat/completions and /v1/completions (streamed SSE passed
through as it arrives), GET /v1/models (merged across backends), /metrics
(Prometheus) and /healthz. Every answer names its backend in the
x-llmdiag-backend header; the access log (stderr by default) has the routing
decision. Settings: the [gateway] and [balancer] sections of --config.

Runs on uvloop when it is importable (it is a dependency); --loop asyncio
forces the standard loop (measured: the same added TTFT; docs/benchmarks.md,
"Gateway").
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import signal
import sys
from typing import Any

from llmdiag.cli.main import EX_USAGE
from llmdiag.config import Config, ConfigError
from llmdiag.gateway.event_loop import LOOP_CHOICES, LoopUnavailable, loop_factory


def register(sub: Any) -> None:
    parser = sub.add_parser("gateway", help="run an OpenAI-compatible streaming gateway that routes with the balancer",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--listen", metavar="ADDR", help="HOST:PORT to serve on (default: [gateway] listen, 127.0.0.1:8080)")
    parser.add_argument("--agent", metavar="URL", action="append", default=[],
                        help="node agent whose /v1/penalties to apply (repeatable; replaces [gateway] agents)")
    parser.add_argument("--loop", choices=LOOP_CHOICES, default="auto",
                        help="event loop: uvloop if importable (auto, the default), or force uvloop / asyncio")
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace, config: Config) -> int:
    from llmdiag.gateway.proxy import Gateway, access_logger
    from llmdiag.router_feedback.balancer import Balancer

    changes: dict[str, Any] = {}
    if args.listen:
        changes["listen"] = args.listen
    if args.agent:
        changes["agents"] = tuple(args.agent)
    try:
        gw_config = dataclasses.replace(config.gateway, **changes)
    except (ValueError, ConfigError) as exc:
        print(f"llmdiag gateway: {exc}", file=sys.stderr)
        return EX_USAGE
    backends = config.backend_list()
    if not backends:
        print("llmdiag gateway: no backends: give --backend URL (repeatable) or [[backends]] in --config", file=sys.stderr)
        return EX_USAGE
    try:
        factory, loop_name = loop_factory(args.loop)
    except LoopUnavailable as exc:
        print(f"llmdiag gateway: {exc}", file=sys.stderr)
        return EX_USAGE
    balancer = Balancer(backends, config.balancer)
    gateway = Gateway(gw_config, balancer, access_log=access_logger(gw_config.access_log), engine_config=config.engine)

    async def serve() -> None:
        await gateway.start()
        # Everything alive now (modules, config, the app) lives as long as the process: take it out of
        # the cyclic GC's view, so a full collection does not walk it again and again mid-request.
        gc.collect()
        gc.freeze()
        names = ", ".join(b.name for b in backends)
        print(f"llmdiag gateway on {gateway.url} ({loop_name}) -> {names}"
              + (f"; penalties from {len(gw_config.agents)} agent(s)" if gw_config.agents else "")
              + "; Ctrl-C to stop", file=sys.stderr, flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            await gateway.stop()

    try:
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(serve())
    except OSError as exc:
        print(f"llmdiag gateway: cannot listen on {gw_config.listen}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    return 0

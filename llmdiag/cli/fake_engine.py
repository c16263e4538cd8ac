"""``llmdiag fake-engine``: a vLLM-like engine (the simulator's engine model on the wall clock) on a real port.

    llmdiag fake-engine --port 8000
    llmdiag fake-engine --port 8001 --profile llama3-8b-a100 --kv-capacity 60000 \\
        --faults "slowdown:start=30,speed=0.4;crash:start=90,down=15"

It serves the OpenAI completions API (streaming or not), /v1/models, /health
and vLLM-named /metrics, so collectors, gateways and load generators can be
tried without a GPU. Fault kinds: slowdown (speed), stall, crash (down),
error_5xx (ratio), kv_shrink (factor); times in seconds from start.
It runs until Ctrl-C or SIGTERM and then exits 130, like every llmdiag command.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from typing import Any

from llmdiag.cli.main import EX_INTERRUPTED, EX_USAGE
from llmdiag.config import Config
from llmdiag.sim.engine_model import PRESETS
from llmdiag.sim.fake_engine import FakeEngine, FakeEngineOptions
from llmdiag.sim.faults import parse_faults


async def _serve(options: FakeEngineOptions) -> int:
    """Serve until SIGINT or SIGTERM; returns the signal that stopped it."""
    engine = FakeEngine(options)
    await engine.start()
    grpc = f" and gRPC on grpc://{options.host}:{engine.grpc_port}" if engine.grpc_port else ""
    print(f"fake engine {options.model} ({options.profile}) serving on {engine.url}{grpc}; Ctrl-C to stop", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    received: list[int] = []
    loop = asyncio.get_running_loop()

    def on_signal(sig: int) -> None:
        received.append(sig)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        await stop.wait()
    finally:
        await engine.stop()
    return received[0]


def handle(args: argparse.Namespace, config: Config) -> int:
    try:
        options = FakeEngineOptions(
            host=args.host, port=args.port, model=args.model, profile=args.profile,
            kv_capacity_tokens=args.kv_capacity, queue_limit=args.queue_limit,
            faults=parse_faults(args.faults or ""), engine_label=args.engine_label, seed=args.seed,
            grpc_port=args.grpc_port,
        )
        FakeEngine(options)  # checks the model options before anything listens
    except ValueError as exc:
        print(f"llmdiag fake-engine: {exc}", file=sys.stderr)
        return EX_USAGE
    try:
        asyncio.run(_serve(options))
    except OSError as exc:
        print(f"llmdiag fake-engine: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    # Stopped by Ctrl-C or SIGTERM: 130, like every other llmdiag command (and the shell).
    return EX_INTERRUPTED


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be 0..65535, got {port}")
    return port


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def register(sub: Any) -> None:
    parser = sub.add_parser("fake-engine", help="run a vLLM-like fake engine (OpenAI API + vLLM /metrics) for demos and tests",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=_port, default=8000, help="port (default 8000; 0 picks a free one)")
    parser.add_argument("--model", default="fake/llama3-8b", help="model name served")
    parser.add_argument("--profile", default="llama3-8b-h100", choices=sorted(PRESETS), help="step-time and capacity preset")
    parser.add_argument("--kv-capacity", type=_positive_int, metavar="TOKENS", help="KV cache capacity in tokens (default: the preset's)")
    parser.add_argument("--queue-limit", type=_positive_int, metavar="N", help="answer 429 (saturation body) when N requests wait")
    parser.add_argument("--faults", metavar="SPEC", help='fault schedule, e.g. "slowdown:start=30,speed=0.4;crash:start=90,down=15"')
    parser.add_argument("--grpc-port", type=_port, default=None, metavar="N",
                        help="also serve an h2c gRPC streaming Generate method on port N (0 picks one)")
    parser.add_argument("--engine-label", default="0", help="value of the engine label on /metrics")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(handler=handle)

"""``llmdiag agent``: the long-running node agent (one per GPU node; a DaemonSet in Kubernetes).

    llmdiag agent --backend http://127.0.0.1:8000 --backend http://127.0.0.1:8001 \\
        --listen 127.0.0.1:9464 --agent-check 127.0.0.1:9465 --token-file /etc/llmdiag/token

It compiles and attaches the BPF collectors once, ticks every ``[agent] interval_seconds``,
runs the analyzers, feeds the balancer, and serves ``/metrics`` (Prometheus),
``/v1/penalties``, ``/v1/state`` and ``/healthz`` over HTTP, plus the HAProxy agent-check
protocol on ``--agent-check``. A bearer token (``--token-file``, ``[agent] token_file``, the
``LLMDIAG_AGENT_TOKEN`` environment variable, or ``[agent] bearer_token``) is then required on
every path but ``/healthz``. SIGTERM stops it within 5 s with exit 0. Every option is also an
``[agent]`` key; see docs/agent.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any

from llmdiag.cli.main import EX_USAGE
from llmdiag.config import Config
from llmdiag.config.agent import split_address

TOKEN_ENV = "LLMDIAG_AGENT_TOKEN"


def _address(text: str) -> str:
    try:
        split_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def resolve_token(config: Config, token_file: str | None) -> str | None:
    """The bearer token: --token-file, else [agent] token_file, else $LLMDIAG_AGENT_TOKEN, else [agent] bearer_token.

    Raises ``ValueError`` for a token file that cannot be read or holds no token."""
    path = token_file or config.agent.token_file
    if path:
        try:
            with open(path, encoding="utf-8") as fh:
                token = fh.read(4096).strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read token file {path}: {getattr(exc, 'strerror', None) or exc}") from None
        if not token or any(c.isspace() for c in token):
            raise ValueError(f"token file {path} must hold one token (no spaces)")
        return token
    return os.environ.get(TOKEN_ENV) or config.agent.bearer_token or None


def handle(args: argparse.Namespace, config: Config) -> int:
    from llmdiag.agent.daemon import run_agent  # noqa: PLC0415 - aiohttp only for this command
    from llmdiag.agent.wiring import COLLECTOR_FACTORIES  # noqa: PLC0415

    # (--config, --backend and -v work after `agent` too: cli.main folds them in for every command.)
    agent = config.agent
    if args.listen:
        host, port = split_address(args.listen)
        agent = dataclasses.replace(agent, listen_host=host, listen_port=port)
    if args.agent_check:
        agent = dataclasses.replace(agent, agent_check_listen=args.agent_check)
    if args.interval is not None:
        agent = dataclasses.replace(agent, interval_seconds=args.interval)
    config = dataclasses.replace(config, agent=agent)
    unknown = [n for n in config.agent.collectors if n not in COLLECTOR_FACTORIES]
    if unknown:
        print(f"llmdiag agent: unknown collector(s) in [agent] collectors: {', '.join(unknown)} "
              f"(available: {', '.join(sorted(COLLECTOR_FACTORIES))})", file=sys.stderr)
        return EX_USAGE
    try:
        token = resolve_token(config, args.token_file)
    except ValueError as exc:
        print(f"llmdiag agent: {exc}", file=sys.stderr)
        return EX_USAGE
    try:
        return run_agent(config, token)
    except OSError as exc:  # the port is taken, or the address is not ours
        print(f"llmdiag agent: cannot listen: {exc.strerror or exc}", file=sys.stderr)
        return 1


def register(sub: Any) -> None:
    from llmdiag.cli.main import positive_seconds  # noqa: PLC0415

    parser = sub.add_parser("agent", help="run the node agent: /metrics, /v1/penalties, /v1/state, HAProxy agent-check",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--listen", type=_address, metavar="ADDR",
                        help="HTTP address host:port (default: [agent] listen_host/listen_port, 127.0.0.1:9464)")
    parser.add_argument("--agent-check", type=_address, metavar="ADDR",
                        help="HAProxy agent-check address host:port (default: [agent] agent_check_listen; off)")
    parser.add_argument("--token-file", metavar="FILE", help=f"bearer token file (or ${TOKEN_ENV}, or [agent] token_file)")
    parser.add_argument("--interval", type=positive_seconds, metavar="S",
                        help="seconds between ticks (default: [agent] interval_seconds, 1)")
    parser.set_defaults(handler=handle)

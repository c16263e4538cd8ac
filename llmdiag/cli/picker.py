"""``llmdiag picker``: llmdiag's balancer as an Envoy Endpoint Picker (ext_proc, Gateway API Inference Extension).

    llmdiag --backend http://10.0.0.7:8000 --backend http://10.0.0.8:8000 picker --listen 127.0.0.1:9002

Envoy (or a Kubernetes inference gateway) asks it, per request, which engine
gets the request; it answers with the x-gateway-destination-endpoint header and
envoy.lb dynamic metadata, and learns each response's status and time to first
token. Backends come from --backend or [[backends]] (models = the pool each
serves) and --discover HOST:PORT (the DNS addresses of a headless Service,
re-resolved); --agent URL adds the node agents' penalties (pulled from /v1/penalties,
ttl-bound, failing open). See docs/integrations/envoy.md for the Envoy bootstrap.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import signal
import sys
from typing import Any

from llmdiag.cli.main import EX_USAGE
from llmdiag.config import Config, ConfigError
from llmdiag.config.picker import PickerConfig
from llmdiag.picker.discovery import DnsBackends
from llmdiag.picker.server import PickerServer
from llmdiag.picker.service import EndpointPickerService
from llmdiag.router_feedback.agent_penalties import AgentPenalties
from llmdiag.router_feedback.balancer import Balancer


def _picker_config(args: argparse.Namespace, config: Config) -> PickerConfig:
    changes: dict[str, Any] = {}
    if args.listen is not None:
        changes["listen"] = args.listen
    if args.metrics_listen is not None:
        changes["metrics_listen"] = args.metrics_listen
    if args.agent:
        changes["agents"] = tuple(args.agent)
    if args.discover is not None:
        changes["discover"] = args.discover
    try:
        return dataclasses.replace(config.picker, **changes)
    except ValueError as exc:
        message = str(exc)
        for key, flag in (("picker.metrics_listen", "--metrics-listen"), ("picker.listen", "--listen"),
                          ("picker.agents", "--agent"),
                          ("picker.discover", "--discover")):
            message = message.replace(key, flag)
        raise ConfigError(message) from None


async def _serve(server: PickerServer) -> None:
    await server.start()
    where = f"; metrics on http://{server.service.config.metrics_listen.rsplit(':', 1)[0]}:{server.metrics_port}/metrics" \
        if server.metrics_port else ""
    names = ", ".join(b.name for b in server.service.balancer.backends) or "no backends yet"
    if server.discovery is not None:
        names += f" (+ DNS {server.discovery.host}:{server.discovery.port})"
    agents = f"; penalties from {len(server.agents.agents)} agent(s)" if server.agents else ""
    print(f"llmdiag picker: ext_proc on port {server.port} for {names}{where}{agents}; Ctrl-C to stop",
          file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await server.stop()


def handle(args: argparse.Namespace, config: Config) -> int:
    try:
        picker_config = _picker_config(args, config)
    except ConfigError as exc:
        print(f"llmdiag picker: {exc}", file=sys.stderr)
        return EX_USAGE
    backends = config.backend_list()
    if not backends and not picker_config.discover:
        print("llmdiag picker: no backends: give --backend URL (repeatable), [[backends]] in the config, "
              "or --discover HOST:PORT", file=sys.stderr)
        return EX_USAGE
    agents = None
    if picker_config.agents:
        try:
            agents = AgentPenalties(picker_config.agents, token=picker_config.agent_token or None,
                                    interval=picker_config.agent_poll_seconds,
                                    timeout=picker_config.agent_timeout_seconds)
        except ValueError as exc:
            print(f"llmdiag picker: --agent: {exc}", file=sys.stderr)
            return EX_USAGE
    service = EndpointPickerService(Balancer(backends, config.balancer), picker_config)
    discovery = (DnsBackends(picker_config.discover, picker_config.discover_models,
                             picker_config.discover_interval_seconds) if picker_config.discover else None)
    server = PickerServer(service, picker_config.listen, picker_config.metrics_listen, agents, discovery)
    try:
        asyncio.run(_serve(server))
    except (OSError, RuntimeError) as exc:  # grpc raises RuntimeError for a bad certificate or key
        print(f"llmdiag picker: {exc}", file=sys.stderr)
        return 1
    return 0


def register(sub: Any) -> None:
    parser = sub.add_parser("picker", help="serve the balancer as an Envoy Endpoint Picker (ext_proc gRPC)",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--listen", metavar="ADDR",
                        help=f"ext_proc gRPC address HOST:PORT (default [picker] listen, {PickerConfig.listen})")
    parser.add_argument("--metrics-listen", metavar="ADDR",
                        help=f"address of /metrics and /healthz, '' for none (default {PickerConfig.metrics_listen})")
    parser.add_argument("--discover", metavar="HOST:PORT",
                        help="backends from the DNS addresses of HOST (a headless Service), re-resolved "
                             "(replaces [picker] discover)")
    parser.add_argument("--agent", metavar="URL", action="append", default=[],
                        help="node agent whose /v1/penalties to apply (repeatable; replaces [picker] agents)")
    parser.set_defaults(handler=handle)

"""The running picker: the ext_proc gRPC server and the HTTP server of its own metrics.

Both run on one asyncio event loop (grpc.aio): no thread pool sits between
Envoy's messages and the balancer, which is what keeps the added latency
per request low (a thread hand-off per message costs more than the pick).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp
import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from llmdiag.config.picker import split_listen
from llmdiag.picker.discovery import DnsBackends
from llmdiag.picker.service import EndpointPickerService
from llmdiag.router_feedback.agent_penalties import AgentPenalties
from llmdiag.router_feedback.probes import AiohttpProbeClient, ProbeRunner

__all__ = ["SERVICE_NAME", "PickerServer"]

log = logging.getLogger("llmdiag.picker")

SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"


class PickerServer:
    """Serves :class:`EndpointPickerService` over gRPC and its metrics over HTTP.

    ``start()`` binds both (port 0 picks a free one: see :attr:`port` and
    :attr:`metrics_port`) and starts pulling the node agents' penalties when
    ``agents`` is given; ``stop()`` ends open streams (their ``finally`` feeds
    the balancer), stops the poller (its penalties are taken back) and closes
    the listeners.
    """

    def __init__(self, service: EndpointPickerService, listen: str, metrics_listen: str = "",
                 agents: AgentPenalties | None = None, discovery: DnsBackends | None = None) -> None:
        self.service = service
        self.agents = agents
        self.discovery = discovery
        self._static = list(service.balancer.backends)
        self._discovery_task: asyncio.Task[None] | None = None
        self.probes: ProbeRunner | None = None
        if service.config.probes:
            service.metrics.watch_probes(
                lambda: (self.probes.probes_total, self.probes.probe_failures_total) if self.probes else (0, 0))
        self._session: aiohttp.ClientSession | None = None
        self._stop = asyncio.Event()
        self._agent_task: asyncio.Task[None] | None = None
        if agents is not None:
            service.metrics.watch_agents(agents)
        self._listen = split_listen(listen, "listen")
        self._metrics_listen = split_listen(metrics_listen, "metrics_listen") if metrics_listen else None
        self._grpc: grpc.aio.Server | None = None
        self._runner: web.AppRunner | None = None
        self.port = 0
        self.metrics_port = 0

    def _apply_discovered(self, backends: list) -> None:
        names = {b.name for b in self._static}
        self.service.set_backends([*self._static, *(b for b in backends if b.name not in names)])

    async def start(self) -> None:
        self._stop.clear()
        if self.discovery is not None:
            # One resolution before serving, so the first requests have the pool; later ones in the background.
            if await self.discovery.poll():
                self._apply_discovered(self.discovery.backends or [])
            self._discovery_task = asyncio.create_task(self.discovery.run(self._apply_discovered, self._stop))
        host, port = self._listen
        server = grpc.aio.server(
            maximum_concurrent_rpcs=self.service.config.max_streams,
            options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", self.service.config.max_body_bytes + 65536)],
        )
        handler = grpc.method_handlers_generic_handler(SERVICE_NAME, {
            "Process": grpc.stream_stream_rpc_method_handler(
                self.service.process,
                request_deserializer=pb.ProcessingRequest.FromString,
                response_serializer=None,  # the service yields serialised bytes
            ),
        })
        server.add_generic_rpc_handlers((handler,))
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        config = self.service.config
        if config.tls_cert_file:
            try:
                with open(config.tls_cert_file, "rb") as f:
                    chain = f.read()
                with open(config.tls_key_file, "rb") as f:
                    key = f.read()
            except OSError as exc:
                raise OSError(f"cannot read the TLS certificate or key: {exc}") from None
            self.port = server.add_secure_port(address, grpc.ssl_server_credentials([(key, chain)]))
        else:
            self.port = server.add_insecure_port(address)
        if not self.port:
            raise OSError(f"cannot listen on {address} (in use or not a local address)")
        await server.start()
        self._grpc = server
        if self._metrics_listen is not None:
            app = web.Application()
            app.router.add_get("/metrics", self._metrics)
            app.router.add_get("/healthz", self._healthz)
            runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
            await runner.setup()
            mhost, mport = self._metrics_listen
            site = web.TCPSite(runner, mhost, mport, reuse_address=True)
            try:
                await site.start()
            except OSError:
                await runner.cleanup()
                await self.stop()
                raise
            self._runner = runner
            sockets = site._server.sockets if site._server else []  # type: ignore[union-attr]
            self.metrics_port = sockets[0].getsockname()[1] if sockets else mport
        if self.agents is not None or config.probes:
            self._session = aiohttp.ClientSession()
        if self.agents is not None:
            self._agent_task = asyncio.create_task(self.agents.run(self._session, self.service.balancer, self._stop))
        if config.probes:
            balancer = self.service.balancer
            self.probes = ProbeRunner(balancer, AiohttpProbeClient(balancer.config.probe_prompt, session=self._session))
            self.probes.start()

    async def stop(self, grace: float = 1.0) -> None:
        self._stop.set()
        if self.probes is not None:
            await self.probes.close()
            self.probes = None
        if self._discovery_task is not None:
            self._discovery_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._discovery_task
            self._discovery_task = None
        if self._agent_task is not None:
            try:
                await asyncio.wait_for(self._agent_task, self.agents.timeout + 1.0 if self.agents else 1.0)
            except asyncio.TimeoutError:
                pass  # wait_for cancelled it; its finally took the penalties back
            except Exception as exc:  # noqa: BLE001 - shutting down: log, do not mask the stop
                log.warning("penalty poller ended with %s", exc)
            self._agent_task = None
        if self._session is not None:
            with contextlib.suppress(Exception):
                await self._session.close()
            self._session = None
        if self._grpc is not None:
            await self._grpc.stop(grace)
            self._grpc = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def wait(self) -> None:
        if self._grpc is not None:
            await self._grpc.wait_for_termination()

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.service.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "backends": [b.name for b in self.service.balancer.backends]})

"""LiteLLM routing with the llmdiag balancer (SPEC 6.4; ``pip install 'llmdiag[litellm]'``).

    from litellm import Router
    from llmdiag.gateway.litellm_strategy import install

    router = Router(model_list=[...], allowed_fails=1)
    strategy = install(router, agents=["http://10.0.0.7:9464"])   # registers plugin + callbacks
    ...
    strategy.close()

What it does, per attempt (LiteLLM calls the strategy for the first try and
for each retry):

* the model group's deployments become balancer backends (named by
  ``model_info.id``, addressed by ``api_base``), kept in sync with the router;
* deployments LiteLLM has cooled down, and those that already failed this
  request (``metadata.previous_models``), are excluded: LiteLLM filters
  neither for a custom strategy;
* ``balancer.pick(group, prompt-token estimate)`` chooses; when the balancer
  has nothing eligible it falls back to any deployment not excluded (LiteLLM's
  own retry and cooldown logic then does its job), and as a last resort to the
  first deployment, so a request is never refused by the strategy itself;
* outcomes come back through LiteLLM's callbacks (:class:`OutcomeLogger`):
  success -> ``on_first_token`` (TTFT = ``completion_start_time - start_time``
  for streams) and ``on_finish(200)``; failure -> ``on_finish`` with the
  exception's status (connection errors as ``connect_error``, timeouts as
  ``timeout``) and its message as the body, so a KV-exhausted 429 cools the
  deployment and an API-key quota 429 does not;
* node agents' penalties (``/v1/penalties``) are polled on a background
  thread and applied ttl-bound; an unreachable agent means penalty 0 (fail
  open), never a failed request.

litellm is imported only by :func:`install` (and the class it builds), so
importing this module costs nothing. Facts about LiteLLM 1.110.2 this relies
on are in ``docs/integrations/litellm.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from llmdiag.config.balancer import BalancerConfig
from llmdiag.model import Backend
from llmdiag.router_feedback.agent_penalties import AgentPenalties
from llmdiag.router_feedback.balancer import Balancer, NoBackendAvailable
from llmdiag.router_feedback.errors import CONNECT_ERROR, TIMEOUT

__all__ = ["LlmdiagRouting", "install", "uninstall"]

log = logging.getLogger(__name__)


def _deployment_id(deployment: Mapping[str, Any]) -> str | None:
    info = deployment.get("model_info") or {}
    dep_id = info.get("id") if isinstance(info, Mapping) else None
    return str(dep_id) if dep_id is not None else None


def _backend_url(deployment: Mapping[str, Any]) -> str:
    """``scheme://host:port`` of the deployment's ``api_base`` (the agent knows engines by that address)."""
    params = deployment.get("litellm_params") or {}
    base = params.get("api_base") if isinstance(params, Mapping) else None
    if isinstance(base, str) and base:
        parts = urlsplit(base)
        if parts.scheme in ("http", "https") and parts.hostname:
            host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
            port = parts.port or (443 if parts.scheme == "https" else 80)
            return f"{parts.scheme}://{host}:{port}"
    # A hosted API without api_base: a placeholder address no agent will ever name.
    return "https://hosted.invalid:443"


def _estimate_tokens(messages: Any, input: Any) -> int:
    chars = 0
    if isinstance(messages, list):
        for m in messages:
            content = m.get("content") if isinstance(m, Mapping) else None
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                chars += sum(len(p.get("text", "")) for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str))
    elif isinstance(input, str):
        chars = len(input)
    elif isinstance(input, list):
        chars = sum(len(x) if isinstance(x, str) else 4 for x in input)
    return max(1, math.ceil(chars / 4))


class LlmdiagRouting:
    """The strategy's logic, independent of LiteLLM's base class (see :func:`install`)."""

    def __init__(self, router: Any, agents: Iterable[str] = (), agent_token: str | None = None,
                 balancer_config: BalancerConfig | None = None, poll_seconds: float = 1.0, agent_timeout: float = 1.0,
                 rng: Any = None) -> None:
        self.router = router
        self.balancer = Balancer((), balancer_config or BalancerConfig(), rng=rng)
        self._rng = rng if rng is not None else random.Random()
        self._groups: dict[str, tuple[str, ...]] = {}  # model group -> deployment ids last synced
        self._sync_lock = threading.Lock()
        self.agents = AgentPenalties(agents, token=agent_token, interval=poll_seconds, timeout=agent_timeout) if agents else None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        #: Counters: picks by deployment id, fallbacks (balancer had nothing), cooled-down skips.
        self.picks: dict[str, int] = {}
        self.fallbacks_total = 0
        self.cooled_down_skipped_total = 0
        self.previous_skipped_total = 0

    # -------------------------------------------------------------- deployments

    def _deployments(self, model: str) -> list[Mapping[str, Any]]:
        found = self.router.registry().deployments(model)
        return [d for d in (found or []) if isinstance(d, Mapping) and _deployment_id(d) is not None]

    def _sync(self, model: str, deployments: Sequence[Mapping[str, Any]]) -> None:
        ids = tuple(sorted(_deployment_id(d) for d in deployments))  # type: ignore[type-var]
        if self._groups.get(model) == ids:
            return
        with self._sync_lock:
            self._groups[model] = ids
            by_name: dict[str, Backend] = {b.name: b for b in self.balancer.backends}
            # Drop this group's deployments that are gone; keep every other group's.
            for name, b in list(by_name.items()):
                if model in b.models and name not in ids:
                    del by_name[name]
            for d in deployments:
                dep_id = _deployment_id(d)
                assert dep_id is not None
                old = by_name.get(dep_id)
                models = tuple(sorted(set(old.models if old else ()) | {model}))
                by_name[dep_id] = Backend(dep_id, _backend_url(d), engine="openai", models=models)
            self.balancer.set_backends(by_name.values())

    def sync_all(self) -> None:
        """Make every deployment of the router a backend now (so agents' penalties match before the first call)."""
        groups: dict[str, list[Mapping[str, Any]]] = {}
        for d in self.router.registry().deployments(None) or []:
            name = d.get("model_name") if isinstance(d, Mapping) else None
            if isinstance(name, str) and _deployment_id(d) is not None:
                groups.setdefault(name, []).append(d)
        for model, deployments in groups.items():
            self._sync(model, deployments)

    # ---------------------------------------------------------------- choosing

    def _excluded(self, request_kwargs: Mapping[str, Any] | None, cooled: Iterable[str]) -> set[str]:
        excluded = set(cooled)
        self.cooled_down_skipped_total += len(excluded)
        metadata = (request_kwargs or {}).get("metadata") or {}
        previous = metadata.get("previous_models") if isinstance(metadata, Mapping) else None
        if isinstance(previous, list):
            for p in previous:
                dep = p.get("deployment_id") if isinstance(p, Mapping) else None
                if dep is None and isinstance(p, Mapping):
                    dep = _deployment_id(p)
                if dep is not None and str(dep) not in excluded:
                    excluded.add(str(dep))
                    self.previous_skipped_total += 1
        return excluded

    def choose(self, model: str, messages: Any, input: Any, request_kwargs: Mapping[str, Any] | None,
               deployments: Sequence[Mapping[str, Any]], cooled: Iterable[str]) -> Mapping[str, Any] | None:
        if not deployments:
            return None
        self._sync(model, deployments)
        excluded = self._excluded(request_kwargs, cooled)
        by_id = {_deployment_id(d): d for d in deployments}
        try:
            backend = self.balancer.pick(model, _estimate_tokens(messages, input), exclude=excluded)
            chosen = by_id.get(backend.name)
        except NoBackendAvailable:
            chosen = None
        if chosen is None:
            # Nothing eligible for the balancer (all ejected/cooling/excluded): let LiteLLM try
            # what it has not excluded, else anything; its retries and cooldowns take it from there.
            self.fallbacks_total += 1
            allowed = [d for i, d in by_id.items() if i not in excluded] or list(deployments)
            chosen = allowed[int(self._rng.random() * len(allowed)) % len(allowed)]
        dep_id = _deployment_id(chosen)
        self.picks[dep_id] = self.picks.get(dep_id, 0) + 1  # type: ignore[index]
        return chosen

    # ---------------------------------------------------------------- outcomes

    def record_success(self, kwargs: Mapping[str, Any], start_time: Any, end_time: Any) -> None:
        dep_id = _callback_deployment(kwargs)
        if dep_id is None or dep_id not in self._known():
            return
        first = kwargs.get("completion_start_time")
        stream = bool(kwargs.get("stream"))
        first_seen = False
        if stream and first is not None and start_time is not None:
            with contextlib.suppress(TypeError, AttributeError):
                self.balancer.on_first_token(dep_id, max(0.0, (first - start_time).total_seconds()))
                first_seen = True
        self.balancer.on_finish(dep_id, 200, None, None, first_token_seen=first_seen)

    def record_failure(self, kwargs: Mapping[str, Any]) -> None:
        dep_id = _callback_deployment(kwargs)
        if dep_id is None or dep_id not in self._known():
            return
        exc = kwargs.get("exception")
        status, body = _failure_status(kwargs, exc)
        headers = None
        response = getattr(exc, "response", None)
        with contextlib.suppress(Exception):
            headers = dict(response.headers) if response is not None else None
        self.balancer.on_finish(dep_id, status, body, headers, first_token_seen=False)

    def _known(self) -> set[str]:
        return {b.name for b in self.balancer.backends}

    # ---------------------------------------------------------------- agents

    def start(self) -> None:
        """Poll the agents on a daemon thread with its own event loop (works for sync and async callers)."""
        if self.agents is None or self._thread is not None:
            return
        ready = threading.Event()

        def run() -> None:
            import aiohttp

            async def main() -> None:
                self._loop = asyncio.get_running_loop()
                self._stop = asyncio.Event()
                ready.set()
                async with aiohttp.ClientSession() as session:
                    await self.agents.run(session, self.balancer, self._stop)  # type: ignore[union-attr]

            try:
                asyncio.run(main())
            except Exception:  # noqa: BLE001 - penalties are an input; without them routing goes on
                log.exception("llmdiag LiteLLM strategy: agent poller stopped")
            finally:
                ready.set()

        self._thread = threading.Thread(target=run, name="llmdiag-agent-penalties", daemon=True)
        self._thread.start()
        ready.wait(5.0)

    def close(self) -> None:
        if self._thread is None:
            return
        if self._loop is not None and self._stop is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(5.0)
        self._thread = None


def _callback_deployment(kwargs: Mapping[str, Any]) -> str | None:
    params = kwargs.get("litellm_params") or {}
    info = params.get("model_info") if isinstance(params, Mapping) else None
    if isinstance(info, Mapping) and info.get("id") is not None:
        return str(info["id"])
    slo = kwargs.get("standard_logging_object") or {}
    dep = slo.get("model_id") if isinstance(slo, Mapping) else None
    return str(dep) if dep is not None else None


def _failure_status(kwargs: Mapping[str, Any], exc: Any) -> tuple[int | str, str]:
    slo = kwargs.get("standard_logging_object") or {}
    info = slo.get("error_information") if isinstance(slo, Mapping) else None
    normalized = str(info.get("normalized_error") or "") if isinstance(info, Mapping) else ""
    name = type(exc).__name__ if exc is not None else ""
    message = str(exc) if exc is not None else ""
    if "CONNECTION_ERROR" in normalized or name == "APIConnectionError":
        return CONNECT_ERROR, message
    if "Timeout" in name or "TIMEOUT" in normalized:
        return TIMEOUT, message
    status = getattr(exc, "status_code", None)
    if isinstance(status, int) and 100 <= status <= 599:
        return status, message
    return 500, message


_CLASSES: dict[str, Any] = {}


def _classes() -> tuple[type, type]:
    """Build (once) the LiteLLM subclasses; this is where litellm gets imported."""
    if not _CLASSES:
        from litellm.integrations.custom_logger import CustomLogger
        from litellm.types.router import CustomRoutingStrategyBase

        class LlmdiagRoutingStrategy(CustomRoutingStrategyBase):
            """LiteLLM's hook: one call per attempt."""

            def __init__(self, routing: LlmdiagRouting) -> None:
                self.routing = routing

            def _cooled(self, ids: list[str]) -> list[str]:
                cooldowns = self.routing.router.health().cooldowns
                return [dep for dep, _ in cooldowns.get_active_cooldowns(model_ids=ids, parent_otel_span=None)]

            async def async_get_available_deployment(self, model, messages=None, input=None, specific_deployment=False,
                                                     request_kwargs=None):
                routing = self.routing
                deployments = routing._deployments(model)
                ids = [_deployment_id(d) for d in deployments]
                cooldowns = routing.router.health().cooldowns
                cooled = [dep for dep, _ in await cooldowns.async_get_active_cooldowns(model_ids=ids, parent_otel_span=None)]
                return routing.choose(model, messages, input, request_kwargs, deployments, cooled)

            def get_available_deployment(self, model, messages=None, input=None, specific_deployment=False,
                                         request_kwargs=None):
                routing = self.routing
                deployments = routing._deployments(model)
                cooled = self._cooled([_deployment_id(d) for d in deployments])  # type: ignore[misc]
                return routing.choose(model, messages, input, request_kwargs, deployments, cooled)

        class OutcomeLogger(CustomLogger):
            """Feeds LiteLLM's outcomes back to the balancer (argument names are what LiteLLM passes by keyword)."""

            def __init__(self, routing: LlmdiagRouting) -> None:
                super().__init__()
                self.routing = routing
                # LiteLLM keeps one logger per class and "fundamental" (str/int/bool) attributes:
                # a distinct string lets two routers each have their own.
                self.llmdiag_routing_id = f"{id(routing):x}"

            def log_success_event(self, kwargs, response_obj, start_time, end_time):
                self.routing.record_success(kwargs, start_time, end_time)

            def log_failure_event(self, kwargs, response_obj, start_time, end_time):
                self.routing.record_failure(kwargs)

            async def async_log_success_event(self, kwargs, response_obj, start_time, end_time):
                self.routing.record_success(kwargs, start_time, end_time)

            async def async_log_failure_event(self, kwargs, response_obj, start_time, end_time):
                self.routing.record_failure(kwargs)

        _CLASSES["strategy"] = LlmdiagRoutingStrategy
        _CLASSES["logger"] = OutcomeLogger
    return _CLASSES["strategy"], _CLASSES["logger"]


def install(router: Any, agents: Iterable[str] = (), agent_token: str | None = None,
            balancer_config: BalancerConfig | None = None, poll_seconds: float = 1.0, rng: Any = None) -> LlmdiagRouting:
    """Register the llmdiag strategy and its outcome callback on ``router``; start polling ``agents``.

    Returns the :class:`LlmdiagRouting` (its ``balancer``, counters, and ``close()``).
    The callback is appended to ``litellm.callbacks``, which is process-wide.
    """
    import litellm

    strategy_cls, logger_cls = _classes()
    routing = LlmdiagRouting(router, agents, agent_token, balancer_config, poll_seconds, rng=rng)
    strategy = strategy_cls(routing)
    router.register_plugin(strategy)
    logger = logger_cls(routing)
    litellm.callbacks = [*list(litellm.callbacks or []), logger]
    routing.strategy, routing.logger = strategy, logger  # type: ignore[attr-defined]
    routing.sync_all()
    routing.start()
    return routing


def uninstall(routing: LlmdiagRouting) -> None:
    """Stop polling and remove the outcome callback from LiteLLM's callback lists."""
    import litellm

    routing.close()
    logger = getattr(routing, "logger", None)
    if logger is None:
        return
    # LiteLLM copies litellm.callbacks into its per-event lists at the first call: remove it everywhere.
    for name in ("callbacks", "input_callback", "success_callback", "failure_callback", "_async_success_callback",
                 "_async_failure_callback", "_async_input_callback", "service_callback"):
        lst = getattr(litellm, name, None)
        if isinstance(lst, list):
            while logger in lst:
                lst.remove(logger)


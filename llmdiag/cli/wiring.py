"""Agent wiring: which collectors exist and how to build them from the config.

``COLLECTOR_FACTORIES`` maps a collector name (as given to
``llmdiag collect --collectors a,b``) to a factory
``factory(config, backends) -> Collector``. A factory may raise
:class:`CollectorUnavailable` with a reason and a hint; the caller reports it
as an ``unavailable`` collector status instead of failing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from llmdiag.collectors.base import Collector, GuardedCollector
from llmdiag.config import Config
from llmdiag.model import Backend, CollectorState, CollectorStatus

__all__ = ["COLLECTOR_FACTORIES", "CollectorUnavailable", "build_collectors", "resolve_backends"]

log = logging.getLogger("llmdiag.agent")


class CollectorUnavailable(RuntimeError):
    """A collector cannot run on this host (no BPF, no NVML, not root...)."""


CollectorFactory = Callable[[Config, list[Backend]], Collector]

#: name -> factory; each collector module's issue adds its entry here.
COLLECTOR_FACTORIES: dict[str, CollectorFactory] = {}


def resolve_backends(config: Config) -> list[Backend]:
    """Configured backends (``[[backends]]`` or ``--backend``), else engines discovered on local ports."""
    backends = config.backend_list()
    if backends or not config.agent.discover:
        return backends
    try:
        from llmdiag.collectors.discovery import discover_engines  # noqa: PLC0415
    except ImportError:
        return []
    try:
        return list(discover_engines())
    except Exception as exc:  # noqa: BLE001 - discovery is best effort
        log.warning("engine discovery failed: %s", exc)
        return []


def build_collectors(
    config: Config, backends: list[Backend], names: list[str] | None = None
) -> tuple[list[GuardedCollector], dict[str, CollectorStatus]]:
    """Build the named collectors (default: ``[agent] collectors``, else all).

    Returns the running collectors, each wrapped in :class:`GuardedCollector`,
    and an ``unavailable`` status for each one that could not start, so a
    missing GPU or BPF never stops the others. Unknown names raise ``ValueError``.
    """
    wanted = list(names or config.agent.collectors or COLLECTOR_FACTORIES)
    unknown = [n for n in wanted if n not in COLLECTOR_FACTORIES]
    if unknown:
        raise ValueError(
            f"unknown collector(s): {', '.join(unknown)} (available: {', '.join(sorted(COLLECTOR_FACTORIES)) or 'none'})"
        )
    running: list[GuardedCollector] = []
    unavailable: dict[str, CollectorStatus] = {}
    for name in wanted:
        try:
            running.append(GuardedCollector(COLLECTOR_FACTORIES[name](config, backends)))
        except CollectorUnavailable as exc:
            unavailable[name] = CollectorStatus(CollectorState.UNAVAILABLE, str(exc))
        except Exception as exc:  # noqa: BLE001 - one broken collector must not stop the agent
            log.warning("collector %s failed to start: %s", name, exc)
            unavailable[name] = CollectorStatus(CollectorState.UNAVAILABLE, f"failed to start: {type(exc).__name__}: {exc}")
    return running, unavailable

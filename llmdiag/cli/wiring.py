"""Agent wiring: which collectors exist and how to build them from the config.

``COLLECTOR_FACTORIES`` maps a collector name (as given to
``llmdiag collect --collectors a,b``) to a factory
``factory(config, backends) -> Collector``. A factory may raise
:class:`CollectorUnavailable` with a reason and a hint; the caller reports it
as an ``unavailable`` collector status instead of failing.
"""

from __future__ import annotations

from collections.abc import Callable

from llmdiag.collectors.base import Collector
from llmdiag.config import Config
from llmdiag.model import Backend

__all__ = ["COLLECTOR_FACTORIES", "CollectorUnavailable"]


class CollectorUnavailable(RuntimeError):
    """A collector cannot run on this host (no BPF, no NVML, not root...)."""


CollectorFactory = Callable[[Config, list[Backend]], Collector]

#: name -> factory; each collector module's issue adds its entry here.
COLLECTOR_FACTORIES: dict[str, CollectorFactory] = {}

"""The running system: wiring, the tick loop, the agent state, the HTTP and agent-check servers.

Everything long-running sits here so that ``llmdiag agent``, ``llmdiag top`` and the
one-shot commands (``collect``, ``diagnose``, ``demo``) share one loop (SPEC section 1):

* :mod:`llmdiag.agent.wiring`: collector factories, ``build_collectors``, ``resolve_backends``;
* :mod:`llmdiag.agent.ticker`: ``snapshot_ticks``, one snapshot per ``[agent] interval_seconds``;
* :mod:`llmdiag.agent.loop`: ``AgentLoop.observe(snapshot) -> AgentState`` and ``analyze``.
"""

from llmdiag.agent.loop import AgentBackend, AgentLoop, AgentState, DiagnoseReport, Episode, analyze
from llmdiag.agent.ticker import snapshot_ticks
from llmdiag.agent.wiring import COLLECTOR_FACTORIES, CollectorUnavailable, build_collectors, resolve_backends

__all__ = [
    "COLLECTOR_FACTORIES", "AgentBackend", "AgentLoop", "AgentState", "CollectorUnavailable", "DiagnoseReport",
    "Episode", "analyze", "build_collectors", "resolve_backends", "snapshot_ticks",
]

"""The demo fleet as a ``llmdiag top`` source (``sim`` sits above ``agent``, so it is wired here)."""

from __future__ import annotations

from llmdiag.agent.sources import LiveSource
from llmdiag.cli.wiring import snapshot_ticks
from llmdiag.config import Config
from llmdiag.model import Backend
from llmdiag.sim.demo_fleet import DEMO_COLLECTORS, DemoFleet

__all__ = ["demo_source"]


def demo_source(config: Config, duration: float | None = None, fleet: DemoFleet | None = None) -> LiveSource:
    """Start the demo fleet and watch it with the real collectors; closing the source stops the fleet."""
    fleet = fleet or DemoFleet()
    fleet.start()
    try:
        backends = fleet.backends()
    except BaseException:
        fleet.stop()
        raise
    return LiveSource(
        config, backends,
        lambda sleep: snapshot_ticks(config, backends, list(DEMO_COLLECTORS), duration=duration, sleep=sleep),
        description=f"demo fleet ({fleet.describe()})", on_close=fleet.stop,
    )

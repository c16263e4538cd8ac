"""Which asyncio event loop the gateway runs on: uvloop when it is importable, else the standard one.

uvloop (libuv, Cython) is a dependency of llmdiag, but an environment may lack
it (a platform without wheels, a distribution package set): the gateway then
runs on the standard loop, with the same behaviour. ``--loop`` forces either.
Measured: the same added TTFT on both; uvloop's streaming rate was higher
in most runs, within the benchmark machine's noise (docs/benchmarks.md, "Gateway").
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["LOOP_CHOICES", "LoopUnavailable", "loop_factory"]

#: Values of ``llmdiag gateway --loop``.
LOOP_CHOICES = ("auto", "uvloop", "asyncio")


class LoopUnavailable(RuntimeError):
    """``--loop uvloop`` on a machine without uvloop."""


def loop_factory(choice: str = "auto") -> tuple[Callable[[], asyncio.AbstractEventLoop] | None, str]:
    """``(factory for asyncio.Runner(loop_factory=...), name of the loop)``; a ``None`` factory is asyncio's own.

    ``auto``: uvloop if it imports, else asyncio; ``uvloop``: uvloop or
    :class:`LoopUnavailable`; ``asyncio``: the standard loop.
    """
    if choice not in LOOP_CHOICES:
        raise ValueError(f"event loop {choice!r}: expected one of {', '.join(LOOP_CHOICES)}")
    if choice == "asyncio":
        return None, "asyncio"
    try:
        import uvloop
    except ImportError as exc:
        if choice == "uvloop":
            raise LoopUnavailable(f"uvloop is not importable here ({exc}); install it or use --loop asyncio") from None
        return None, "asyncio"
    return uvloop.new_event_loop, "uvloop"

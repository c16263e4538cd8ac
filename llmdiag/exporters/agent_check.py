"""HAProxy agent-check replies (SPEC 6.4), verified against HAProxy 2.6.

HAProxy connects to the agent port, sends its ``agent-send`` string (``backend/server\\n``
by convention), reads one line and closes. The reply states everything every time,
because ``drain`` and ``down`` are sticky in HAProxy until ``ready`` / ``up``:

=====================================  =====================================
backend state                          reply
=====================================  =====================================
healthy, degraded, warming, half_open  ``ready up 64%`` (the weight percent, an integer)
cooling                                ``drain up`` (no new sessions; running ones finish)
ejected                                ``ready down #<why>`` (the space before ``#`` matters)
unknown server name                    ``ready up 100%`` (fail open: a typo never takes a server down)
=====================================  =====================================

``maxconn:N`` is appended when configured. ``N%`` is relative to the server's
configured weight: ``50%`` on ``weight 100`` gives 50.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from llmdiag.model import BackendPenalty, BackendState

__all__ = ["UNKNOWN_REPLY", "agent_check_reply", "find_backend"]

#: What an unknown name gets: full weight (never take a server down for a name mismatch).
UNKNOWN_REPLY = "ready up 100%\n"

# HAProxy's agent parser splits words on spaces, tabs and commas, and a '#' starts the free text
# up to the end of the line: keep the reason on one line and free of control characters.
_UNSAFE = re.compile(r"[\x00-\x1f\x7f]+")


def agent_check_reply(entry: BackendPenalty | None, maxconn: int = 0) -> str:
    """The one-line reply (with its newline) for one backend, or :data:`UNKNOWN_REPLY` for ``None``."""
    # The admin word (ready/drain) and the operational word (up/down) both, every time.
    if entry is None:
        words = ["ready", "up", "100%"]
    elif entry.state is BackendState.EJECTED:
        why = entry.reasons[0].summary if entry.reasons else "ejected"
        words = ["ready", "down", "#" + (_UNSAFE.sub(" ", why).strip()[:200] or "ejected")]
    elif entry.state is BackendState.COOLING:
        words = ["drain", "up"]
    else:
        words = ["ready", "up", f"{int(entry.weight_percent)}%"]
    if maxconn > 0 and entry is not None:
        # maxconn goes before the comment: everything after '#' is free text.
        words.insert(2, f"maxconn:{maxconn}")
    return " ".join(words) + "\n"


def find_backend(request: str, backends: Mapping[str, BackendPenalty]) -> BackendPenalty | None:
    """The backend an ``agent-send`` line names: ``backend/server``, a bare server name, or ``ip:port``.

    A name equal to an llmdiag backend's name wins; ``backend/server`` then matches the llmdiag
    backend named ``server`` (HAProxy server names are usually the engine names); an ``ip:port``
    matches the backend's address. ``None`` when nothing matches.
    """
    name = request.strip()
    if not name:
        return None
    if name in backends:
        return backends[name]
    if "/" in name:
        server = name.partition("/")[2]
        if server in backends:
            return backends[server]
    for entry in backends.values():
        if entry.address == name:
            return entry
    return None

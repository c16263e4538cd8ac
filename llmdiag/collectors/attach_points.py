"""Every kernel attach point llmdiag's collectors use, as each collector declares it.

``llmdiag doctor`` checks these instead of keeping its own list: a collector
that gains or drops a tracepoint changes what doctor checks with it. The
BPF collectors read theirs from their own ``.bpf.c`` programs
(:func:`llmdiag.bpf.loader.program_tracepoints`).
"""

from __future__ import annotations

from llmdiag.collectors import cuda_alloc, http2, tcp
from llmdiag.collectors.base import AttachNeed

__all__ = ["all_attach_points"]


def all_attach_points() -> list[AttachNeed]:
    """The tcp, http2 and cuda collectors' attach points, in that order."""
    return tcp.attach_points() + http2.attach_points() + cuda_alloc.attach_points()

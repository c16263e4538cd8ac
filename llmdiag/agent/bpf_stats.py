"""What the agent's BPF programs cost and lose, for ``/metrics``: lost events are read once per
tick, run-time statistics once per scrape (the agent's ``TickExposition`` live part).

* lost events: :meth:`llmdiag.bpf.loader.Program.errors` (``lost_events``) of each collector's program;
* in-kernel run time and run count per program: the ``run_time_ns`` and ``run_cnt`` lines of
  ``/proc/self/fdinfo/<fd>`` for each loaded program fd (the kernel fills them only while
  ``kernel.bpf_stats_enabled=1``; without it the lines read 0 and are left out).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from llmdiag.collectors.base import GuardedCollector

__all__ = ["lost_events", "program_stats"]

log = logging.getLogger("llmdiag.agent")


def _programs(collectors: Iterable[GuardedCollector]) -> Iterable[tuple[str, Any]]:
    for c in collectors:
        program = getattr(c.inner, "program", None)
        if program is not None and not getattr(program, "closed", False):
            yield c.name, program


def lost_events(collectors: Iterable[GuardedCollector]) -> dict[str, int]:
    """Collector name -> BPF events lost so far (collectors with a loaded program only)."""
    out: dict[str, int] = {}
    for name, program in _programs(collectors):
        try:
            out[name] = int(program.errors().get("lost_events", 0))
        except Exception as exc:  # noqa: BLE001 - a metric must never break the tick
            log.debug("lost events of %s unreadable: %s", name, exc)
    return out


def program_stats(collectors: Iterable[GuardedCollector], proc_root: str = "/proc") -> tuple[dict[str, float], dict[str, int]]:
    """``({program: run seconds}, {program: runs})`` from fdinfo; programs named ``collector/function``."""
    seconds: dict[str, float] = {}
    runs: dict[str, int] = {}
    for name, program in _programs(collectors):
        funcs = getattr(getattr(program, "bpf", None), "funcs", None) or {}
        for func_name, func in list(funcs.items()):
            fd = getattr(func, "fd", None)
            if not isinstance(fd, int) or fd < 0:
                continue
            fields = _fdinfo(Path(proc_root) / "self" / "fdinfo" / str(fd))
            run_ns, run_cnt = fields.get("run_time_ns"), fields.get("run_cnt")
            if run_ns is None or run_cnt is None or (run_ns == 0 and run_cnt == 0):
                continue
            label = f"{name}/{func_name.decode() if isinstance(func_name, bytes) else func_name}"
            seconds[label] = run_ns / 1e9
            runs[label] = run_cnt
    return seconds, runs


def _fdinfo(path: Path) -> dict[str, int]:
    try:
        text = path.read_text()
    except OSError:
        return {}
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        value = value.strip()
        if value.isdigit():
            out[key.strip()] = int(value)
    return out

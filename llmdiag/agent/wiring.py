"""Which collectors exist, how to build them from the config, and which backends to watch.

``COLLECTOR_FACTORIES`` maps a collector name (as given to
``llmdiag collect --collectors a,b``) to a factory
``factory(config, backends) -> Collector``. A factory may raise
:class:`CollectorUnavailable` with a reason and a hint; the caller reports it
as an ``unavailable`` collector status instead of failing.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from llmdiag.collectors.base import Collector, CollectorUsageError, GuardedCollector
from llmdiag.collectors.discovery import discover_engines, local_backend_pids
from llmdiag.collectors.gpu import build_gpu_collector
from llmdiag.collectors.kube import PodMetadataReader
from llmdiag.collectors.procfs import build_proc_collector
from llmdiag.config import Config
from llmdiag.model import Backend, CollectorState, CollectorStatus

__all__ = ["COLLECTOR_FACTORIES", "CollectorUnavailable", "build_collectors", "resolve_backends"]

log = logging.getLogger("llmdiag.agent")


class CollectorUnavailable(RuntimeError):
    """A collector cannot run on this host (no BPF, no NVML, not root...)."""


CollectorFactory = Callable[[Config, list[Backend]], Collector]

#: name -> factory; each collector module's issue adds its entry here.
COLLECTOR_FACTORIES: dict[str, CollectorFactory] = {
    "engine": lambda config, backends: _engine_factory(config, backends),
    "gpu": lambda config, backends: build_gpu_collector(config, backends),
    "proc": lambda config, backends: build_proc_collector(config, backends),
    "tcp": lambda config, backends: _tcp_factory(config, backends),
    "timewait": lambda config, backends: _timewait_factory(config, backends),
    "cuda": lambda config, backends: _cuda_factory(config, backends),
    "http2": lambda config, backends: _http2_factory(config, backends),
    "envoy": lambda config, backends: _envoy_factory(config, backends),
}


def _envoy_factory(config: Config, backends: list[Backend]) -> Collector:
    from llmdiag.collectors.envoy_admin import build_envoy_collector  # noqa: PLC0415

    try:
        return build_envoy_collector(config, backends)
    except LookupError as exc:
        raise CollectorUnavailable(str(exc)) from exc


def _engine_factory(config: Config, backends: list[Backend]) -> Collector:
    from llmdiag.collectors.engine import build_engine_collector  # noqa: PLC0415

    return build_engine_collector(config, backends)


def _tcp_factory(config: Config, backends: list[Backend]) -> Collector:
    from llmdiag.collectors.tcp import build_tcp_collector  # noqa: PLC0415 - compiles BPF only when asked

    collector = build_tcp_collector(config, backends)
    if collector.unavailable is not None:
        raise CollectorUnavailable(f"{collector.unavailable.reason} (hint: {collector.unavailable.hint})")
    return collector


def _cuda_factory(config: Config, backends: list[Backend]) -> Collector:
    from llmdiag.bpf.loader import BPFUnavailable  # noqa: PLC0415
    from llmdiag.collectors.cuda_alloc import build_cuda_collector  # noqa: PLC0415 - compiles BPF only when asked

    try:
        return build_cuda_collector(config, backends)
    except BPFUnavailable as exc:
        raise CollectorUnavailable(str(exc)) from exc


def _http2_factory(config: Config, backends: list[Backend]) -> Collector:
    from llmdiag.bpf.loader import BPFUnavailable  # noqa: PLC0415
    from llmdiag.collectors.http2 import build_http2_collector  # noqa: PLC0415 - compiles BPF only when asked

    try:
        return build_http2_collector(config, backends)
    except BPFUnavailable as exc:
        raise CollectorUnavailable(str(exc)) from exc


def _timewait_factory(config: Config, backends: list[Backend]) -> Collector:
    from llmdiag.collectors.timewait import build_timewait_collector  # noqa: PLC0415

    return build_timewait_collector(config, backends)


def resolve_backends(config: Config, kube: PodMetadataReader | None = None) -> list[Backend]:
    """Configured backends (``[[backends]]`` or ``--backend``), else engines discovered on local ports;
    each local one labelled with its Kubernetes pod, namespace, container and node (read from /proc,
    :class:`~llmdiag.collectors.kube.PodMetadataReader`; labels from the config win)."""
    backends = config.backend_list()
    if backends:
        # `--backend http://127.0.0.1:8000` carries no pid: find the local process listening
        # on that port, so the /proc, GPU and CUDA collectors can attach to it.
        try:
            pids = local_backend_pids(backends)
        except Exception as exc:  # noqa: BLE001 - best effort; collectors then see no pid
            log.warning("finding the processes of the configured backends failed: %s", exc)
            pids = {}
        backends = [b.with_process(pids[b.name], b.gpus) if b.name in pids and not b.pid else b for b in backends]
    elif config.agent.discover:
        try:
            backends = list(discover_engines())
        except Exception as exc:  # noqa: BLE001 - discovery is best effort
            log.warning("engine discovery failed: %s", exc)
            backends = []
    if kube is None:
        kube = PodMetadataReader(getattr(config.proc, "proc_root", "/proc"), os.environ.get("NODE_NAME"))
    try:
        return kube.label_backends(backends)
    except Exception as exc:  # noqa: BLE001 - labels are a nicety; the backends stand without them
        log.warning("reading the Kubernetes labels of the backends failed: %s", exc)
        return backends


#: ``progress(name, status)``: ``status`` None when collector ``name`` starts building (a BPF
#: compile takes seconds), then its status once built (ok, or unavailable with the reason).
BuildProgress = Callable[[str, CollectorStatus | None], None]


def build_collectors(
    config: Config, backends: list[Backend], names: list[str] | None = None,
    progress: BuildProgress | None = None,
) -> tuple[list[GuardedCollector], dict[str, CollectorStatus]]:
    """Build the named collectors (default: ``[agent] collectors``, else all).

    Returns the running collectors, each wrapped in :class:`GuardedCollector`,
    and an ``unavailable`` status for each one that could not start, so a
    missing GPU or BPF never stops the others. Unknown names raise ``ValueError``.
    ``progress`` (see :data:`BuildProgress`) lets a terminal show each collector as it starts.
    """
    wanted = list(names or config.agent.collectors or COLLECTOR_FACTORIES)
    unknown = [n for n in wanted if n not in COLLECTOR_FACTORIES]
    if unknown:
        raise ValueError(
            f"unknown collector(s): {', '.join(unknown)} (available: {', '.join(sorted(COLLECTOR_FACTORIES)) or 'none'})"
        )
    running: list[GuardedCollector] = []
    unavailable: dict[str, CollectorStatus] = {}
    try:
        for name in wanted:
            if progress is not None:
                progress(name, None)
            try:
                running.append(GuardedCollector(COLLECTOR_FACTORIES[name](config, backends)))
            except CollectorUnavailable as exc:
                unavailable[name] = CollectorStatus(CollectorState.UNAVAILABLE, str(exc))
            except CollectorUsageError:
                raise  # the user's input is wrong (--nvml-replay FILE): the command exits 64 naming it
            except Exception as exc:  # noqa: BLE001 - one broken collector must not stop the agent
                log.warning("collector %s failed to start: %s", name, exc)
                unavailable[name] = CollectorStatus(CollectorState.UNAVAILABLE, f"failed to start: {type(exc).__name__}: {exc}")
            if progress is not None:
                progress(name, unavailable.get(name, CollectorStatus(CollectorState.OK)))
    except BaseException:
        # Interrupted (Ctrl-C, SIGTERM) while a later collector compiled: close what already runs.
        for collector in running:
            collector.close()
        raise
    _connect(running)
    return running, unavailable


def _connect(running: list[GuardedCollector]) -> None:
    """Wire collectors that feed each other, explicitly (no module-level registry).

    The timewait collector's entry rate per destination comes from the tcp collector's
    in-kernel active-close counters when that collector runs; else from the kernel timers.
    """
    inner = {c.name: c.inner for c in running}
    tcp, timewait = inner.get("tcp"), inner.get("timewait")
    if tcp is not None and timewait is not None and hasattr(timewait, "set_entry_source"):
        timewait.set_entry_source(tcp.active_closes_by_destination)

"""CUDA allocation tracer: uprobes on the driver's memory calls in backend processes.

SPEC section 4 ("cuda alloc tracer") and docs/cuda_tracer.md. The BPF side is
``llmdiag/bpf/cuda_alloc.bpf.c``; this module finds the processes, attaches,
and turns the maps into signals once per tick.

Which processes: each backend's ``pid`` and (``[cuda] include_children``) its
descendants, because engines allocate in child processes. A process is traced
once it has ``libcuda.so*`` in ``/proc/PID/maps``; engines load the driver at
CUDA initialisation, long after start-up, so the search repeats every
``rescan_seconds`` and attaches to newcomers. Until one process is traced the
status is ``degraded`` ("no backend process maps libcuda.so").

What is attached, per process: a uprobe and a uretprobe on each of
``cuMemAlloc_v2``, ``cuMemAllocAsync``, ``cuMemCreate``, ``cuMemFree_v2``,
``cuMemFreeAsync`` and ``cuMemRelease`` that the mapped library exports (read
from its ELF ``.dynsym``); the first two are required.

Signals (Scope.BACKEND, subject = backend name; counters since tracing began,
summed over the backend's processes, including ones that have exited):

* ``cuda_alloc_total``, ``cuda_free_total``: successful allocations and frees;
* ``cuda_alloc_failures_total``: allocations that returned an error (plain, as
  the analyzers read it), ``cuda_alloc_failures_by_code_total``: the same by
  ``code`` (CUresult; 2 = CUDA_ERROR_OUT_OF_MEMORY), ``cuda_free_failures_total``;
* ``cuda_alloc_bytes_total``, ``cuda_free_bytes_total`` (frees of allocations
  that were seen), ``cuda_free_untracked_total`` (frees of memory allocated
  before tracing began: their size is unknown);
* ``cuda_outstanding_bytes``: Labelled ``{"pid=N": bytes}`` per live process,
  bytes allocated and not yet freed *since tracing began* (a process that
  exits has freed everything, so it leaves the label set);
* ``cuda_alloc_size_bytes``: Labelled, a cumulative Prometheus-style histogram
  of successful allocation sizes, ``{"le=512": n, ..., "le=+Inf": total}``,
  bounds at powers of two, only the populated range;
* ``cuda_api_calls_total``: Labelled ``{"api=cuMemAlloc_v2,code=0": n}``;
* ``cuda_traced_processes``: processes of the backend traced now.

Host scope: ``cuda_tracer_map_full_total`` (an allocation or count that did
not fit its map) and ``cuda_tracer_read_errors_total`` (the device pointer
could not be read back from the process).

Not per GPU: uprobes see pids, not devices (the device is the context's,
implicit in the call); NVML's per-process memory is the per-GPU view.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmdiag.bpf import features
from llmdiag.bpf.loader import BPFUnavailable, Program, check_environment
from llmdiag.collectors.base import AttachNeed
from llmdiag.collectors.cuda_libs import ElfError, MappedLibrary, descendants, exported_functions, find_library
from llmdiag.collectors.discovery import local_backend_pids
from llmdiag.config import Config
from llmdiag.config.cuda import CudaConfig
from llmdiag.model import Backend, CollectorState, CollectorStatus, Labelled, Sample, Scope, label_key

__all__ = [
    "API_NAMES",
    "HIST_SLOTS",
    "PROBES",
    "REQUIRED_SYMBOLS",
    "CudaAllocCollector",
    "attach_points",
    "build_cuda_collector",
    "program_defines",
    "size_histogram",
]

log = logging.getLogger("llmdiag.collectors.cuda")

PROGRAM = "cuda_alloc"

#: Index = ``enum cuda_api`` in cuda_alloc.h.
API_NAMES = ("cuMemAlloc_v2", "cuMemAllocAsync", "cuMemCreate", "cuMemFree_v2", "cuMemFreeAsync", "cuMemRelease")
_ALLOC_APIS = frozenset({0, 1, 2})

#: (exported symbol, BPF function suffix): ``on_<suffix>`` at entry, ``ret_<suffix>`` at return.
PROBES = (
    ("cuMemAlloc_v2", "mem_alloc"),
    ("cuMemAllocAsync", "mem_alloc_async"),
    ("cuMemCreate", "mem_create"),
    ("cuMemFree_v2", "mem_free"),
    ("cuMemFreeAsync", "mem_free_async"),
    ("cuMemRelease", "mem_release"),
)
REQUIRED_SYMBOLS = ("cuMemAlloc_v2", "cuMemFree_v2")

#: ``CUDA_HIST_SLOTS`` in cuda_alloc.h: slot i counts sizes in (2^(i-1), 2^i].
HIST_SLOTS = 64

#: pid_stats fields summed into counters, as (BPF field, signal name).
_COUNTERS = (
    ("allocs", "cuda_alloc_total"),
    ("frees", "cuda_free_total"),
    ("alloc_failures", "cuda_alloc_failures_total"),
    ("free_failures", "cuda_free_failures_total"),
    ("alloc_bytes", "cuda_alloc_bytes_total"),
    ("freed_bytes", "cuda_free_bytes_total"),
    ("frees_untracked", "cuda_free_untracked_total"),
)

_MAX_INFLIGHT = 16384


def program_defines(config: CudaConfig) -> dict[str, int]:
    """The ``-D`` options of cuda_alloc.bpf.c for a config (``render(PROGRAM, program_defines(c))``
    shows the program without loading it)."""
    return {"MAX_PIDS": config.max_pids, "MAX_LIVE": config.max_live_allocations, "MAX_INFLIGHT": _MAX_INFLIGHT}


def size_histogram(slots: Sequence[int]) -> Labelled:
    """Per-slot counts (slot i = sizes in (2^(i-1), 2^i]) as a cumulative ``le`` histogram over
    the populated range, plus ``le=+Inf``. Empty when nothing was counted."""
    out = Labelled()
    populated = [i for i, n in enumerate(slots) if n]
    if not populated:
        return out
    running = sum(slots[: populated[0]])
    for i in range(populated[0], populated[-1] + 1):
        running += slots[i]
        out[label_key(le=1 << i)] = running
    out[label_key(le="+Inf")] = sum(slots)
    return out


def _signed(value: int) -> int:
    # outstanding_bytes is a u64 updated with two's-complement adds.
    return value - (1 << 64) if value >= 1 << 63 else value


@dataclass
class _Traced:
    """One process with probes attached."""

    tgid: int
    backend: str
    library: str  # the path the probes were attached through (/proc/TGID/root/...)
    symbols: tuple[str, ...]


@dataclass
class _Counts:
    """Counters of one backend, from its processes (live ones re-read each tick)."""

    fields: Counter[str] = field(default_factory=Counter)
    size_slots: list[int] = field(default_factory=lambda: [0] * HIST_SLOTS)
    results: Counter[tuple[int, int]] = field(default_factory=Counter)  # (api, code) -> calls

    def add_stats(self, stats: Mapping[str, Any]) -> None:
        for name, _ in _COUNTERS:
            self.fields[name] += int(stats.get(name, 0))
        for i, n in enumerate(stats.get("size_slots", ())[:HIST_SLOTS]):
            self.size_slots[i] += int(n)

    def merged(self, other: _Counts) -> _Counts:
        return _Counts(self.fields + other.fields, [a + b for a, b in zip(self.size_slots, other.size_slots)],
                       self.results + other.results)


ProgramLoader = Callable[[str, Mapping[str, object]], Program]


class CudaAllocCollector:
    """Traces CUDA driver allocations of backend processes. Roots: ``proc_root`` and the
    program loader are constructor arguments; ``backends`` carry the pids.

    The constructor loads the BPF program (raises :class:`BPFUnavailable` when it cannot)
    and attaches to every backend process that already maps libcuda.
    """

    name = "cuda"

    def __init__(
        self,
        config: CudaConfig,
        backends: Sequence[Backend],
        *,
        proc_root: str | Path = "/proc",
        load: ProgramLoader = Program.load,
    ) -> None:
        self.config = config
        self.backends = list(backends)
        self.proc_root = Path(proc_root)
        self.program = load(PROGRAM, program_defines(config))
        self._traced: dict[int, _Traced] = {}
        self._failed: dict[int, str] = {}  # tgid -> why it could not be traced (until it exits)
        self._candidates: dict[int, str] = {}  # tgid -> backend, from the last scan
        self._last_pids: dict[str, int] = {}  # backend -> pid of its listener, from the last scan
        self._retired: dict[str, _Counts] = {}  # backend -> counts of its exited processes
        self._symbols: dict[tuple[int, int], set[str]] = {}  # (st_dev, st_ino) -> exported functions
        self._last_scan: float | None = None
        self._last_ok_ts: float | None = None
        self._errors: dict[str, int] = {}
        self._closed = False
        self._without_driver: dict[int, int] = {}  # tgid -> vsize when its maps last showed no driver
        self.scan()

    # -- finding and attaching ---------------------------------------------------
    def scan(self) -> None:
        """Look for backend processes that map libcuda and are not traced yet; attach to them."""
        roots = {pid: name for name, pid in self._backend_pids().items()}
        sizes: dict[int, int] = {}
        if self.config.include_children:
            tree = descendants(roots, self.proc_root, sizes)
        else:
            tree = {pid: pid for pid in roots if (self.proc_root / str(pid)).is_dir()}
        self._candidates = {tgid: roots[root] for tgid, root in tree.items()}
        # A process whose address space has the size it had when its maps showed no driver has
        # mapped nothing since (loading libcuda adds its code and data, and CUDA's own mappings
        # follow): its maps, the costly read of a rescan, are not read again.
        self._without_driver = {t: v for t, v in self._without_driver.items() if t in self._candidates}
        for tgid, backend in sorted(self._candidates.items()):
            if tgid in self._traced or tgid in self._failed:
                continue
            vsize = sizes.get(tgid)
            if vsize is not None and self._without_driver.get(tgid) == vsize:
                continue
            library = find_library(tgid, self.config.library_names, self.proc_root)
            if library is None:
                if vsize is not None:
                    self._without_driver[tgid] = vsize
                continue
            self._without_driver.pop(tgid, None)
            try:
                self._attach(tgid, backend, library)
            except (BPFUnavailable, ElfError, OSError) as exc:
                reason = exc.reason if isinstance(exc, BPFUnavailable) else str(exc)
                self._failed[tgid] = f"pid {tgid} ({backend}): {reason}"
                log.warning("cuda tracer: cannot trace pid %d of %s: %s", tgid, backend, reason)

    def _backend_pids(self) -> dict[str, int]:
        """Backend name -> pid: ``Backend.pid`` when discovery filled it, else the local process
        listening on the backend's port (``--backend http://127.0.0.1:8000`` carries no pid)."""
        # The owners found last time are checked first: a rescan every rescan_seconds then reads
        # those processes' descriptors only, not every process's on the host.
        self._last_pids = local_backend_pids(self.backends, self.proc_root, likely=self._last_pids.values())
        return self._last_pids

    def _exports(self, path: str) -> set[str]:
        st = os.stat(path)
        key = (st.st_dev, st.st_ino)
        if key not in self._symbols:
            self._symbols[key] = exported_functions(path)
        return self._symbols[key]

    def _attach(self, tgid: int, backend: str, library: MappedLibrary) -> None:
        if library.deleted:
            raise ElfError(f"{library.path} was replaced after the process mapped it (driver upgraded?): "
                           "probes on the new file would never fire; restart the engine")
        # Through the process's own root: the path in maps is in its mount namespace (containers).
        path = f"{self.proc_root}/{tgid}/root{library.path}"
        exports = self._exports(path)
        missing = [s for s in REQUIRED_SYMBOLS if s not in exports]
        if missing:
            raise ElfError(f"{library.path} does not export {', '.join(missing)} (not the CUDA driver?)")
        symbols = tuple(symbol for symbol, _ in PROBES if symbol in exports)
        try:
            for symbol, suffix in PROBES:
                if symbol in exports:
                    # Return probe first: a return without its entry is ignored, an entry
                    # without its return would sit in the inflight map.
                    self.program.attach_uretprobe(path, symbol, f"ret_{suffix}", tgid)
                    self.program.attach_uprobe(path, symbol, f"on_{suffix}", tgid)
        except BPFUnavailable:
            self._detach(tgid)
            raise
        self._traced[tgid] = _Traced(tgid, backend, path, symbols)
        log.info("cuda tracer: tracing pid %d of %s through %s (%s)", tgid, backend, library.path, ", ".join(symbols))

    def _detach(self, tgid: int) -> None:
        # By pid, not by symbol: the library path under /proc/TGID/root is gone once it exits.
        self.program.detach_uprobes(tgid)

    # -- processes that exit -------------------------------------------------------
    def _exited(self) -> list[int]:
        gone = [tgid for tgid in self._traced if not (self.proc_root / str(tgid)).is_dir()]
        for tgid in [t for t in self._failed if not (self.proc_root / str(t)).is_dir()]:
            del self._failed[tgid]
        return gone

    def _retire(self, tgid: int, stats: Mapping[str, Any] | None, results: list[tuple[dict[str, int], int]]) -> None:
        """Fold an exited process's final counts into its backend's and free its map entries."""
        traced = self._traced.pop(tgid)
        counts = self._retired.setdefault(traced.backend, _Counts())
        if stats is not None:
            counts.add_stats(stats)
        for key, calls in results:
            if key["tgid"] == tgid:
                counts.results[(key["api"], key["code"])] += calls
        self._detach(tgid)
        self._delete_where_tgid("pid_stats", tgid)
        self._delete_where_tgid("call_results", tgid)
        self._delete_where_tgid("live_allocs", tgid)

    def _delete_where_tgid(self, map_name: str, tgid: int) -> None:
        table = self.program.table(map_name)
        for key in list(table.keys()):
            # struct keys have a tgid field; pid_stats is keyed by the bare tgid (a c_uint).
            key_tgid = key.tgid if hasattr(key, "tgid") else key.value
            if key_tgid == tgid:
                try:
                    del table[key]
                except KeyError:
                    pass

    # -- the collector contract ------------------------------------------------------
    def collect(self, now: float) -> list[Sample]:
        if self._closed:
            return []
        # Exited processes first: once gone they make no more calls, so the read below is final.
        exited = self._exited()
        stats = dict(self.program.read_hash("pid_stats"))
        results = self.program.read_hash("call_results")
        for tgid in exited:
            self._retire(tgid, stats.pop(tgid, None), results)
        if self._last_scan is None or not 0 <= now - self._last_scan < self.config.rescan_seconds:
            self._last_scan = now
            self.scan()
        samples = self._backend_samples(stats, results)
        self._errors = self.program.errors()
        samples.append(Sample(Scope.HOST, "", "cuda_tracer_map_full_total", self._errors.get("map_full", 0)))
        samples.append(Sample(Scope.HOST, "", "cuda_tracer_read_errors_total", self._errors.get("read", 0)))
        self._last_ok_ts = now
        return samples

    def _backend_samples(self, stats: Mapping[int, Mapping[str, Any]],
                         results: list[tuple[dict[str, int], int]]) -> list[Sample]:
        live: dict[str, _Counts] = {}
        outstanding: dict[str, Labelled] = {}
        processes: Counter[str] = Counter()
        for traced in self._traced.values():
            live.setdefault(traced.backend, _Counts())
            outstanding.setdefault(traced.backend, Labelled())
            processes[traced.backend] += 1
            entry = stats.get(traced.tgid)
            # No entry yet = no call yet: a real zero, the probes are in place.
            outstanding[traced.backend][label_key(pid=traced.tgid)] = _signed(int(entry["outstanding_bytes"])) if entry else 0
            if entry:
                live[traced.backend].add_stats(entry)
        for key, calls in results:
            traced = self._traced.get(key["tgid"])
            if traced is not None:
                live[traced.backend].results[(key["api"], key["code"])] += calls
        samples: list[Sample] = []
        for backend in sorted(set(live) | set(self._retired)):
            counts = live.get(backend, _Counts()).merged(self._retired.get(backend, _Counts()))
            samples.extend(Sample(Scope.BACKEND, backend, signal, counts.fields[name]) for name, signal in _COUNTERS)
            by_code = Labelled()
            calls = Labelled()
            for (api, code), n in sorted(counts.results.items()):
                api_name = API_NAMES[api] if 0 <= api < len(API_NAMES) else str(api)
                calls.add(n, api=api_name, code=code)
                if api in _ALLOC_APIS and code != 0:
                    by_code.add(n, code=code)
            samples.append(Sample(Scope.BACKEND, backend, "cuda_alloc_failures_by_code_total", by_code))
            samples.append(Sample(Scope.BACKEND, backend, "cuda_api_calls_total", calls))
            samples.append(Sample(Scope.BACKEND, backend, "cuda_alloc_size_bytes", size_histogram(counts.size_slots)))
            samples.append(Sample(Scope.BACKEND, backend, "cuda_outstanding_bytes", outstanding.get(backend, Labelled())))
            samples.append(Sample(Scope.BACKEND, backend, "cuda_traced_processes", processes[backend]))
        return samples

    def status(self) -> CollectorStatus:
        if self._closed:
            return CollectorStatus(CollectorState.UNAVAILABLE, "closed")
        names = ", ".join(self.config.library_names)
        if not self._candidates:
            return CollectorStatus(CollectorState.DEGRADED,
                                   "no backend process on this host: no backend has a pid and none of their ports "
                                   f"is listened on locally; re-checking every {self.config.rescan_seconds:g}s",
                                   self._last_ok_ts)
        problems = list(self._failed.values())[:3]
        if self._errors.get("map_full"):
            problems.append(f"{self._errors['map_full']} map-full failures: outstanding bytes under-count "
                            "(raise [cuda] max_live_allocations / max_pids)")
        if not self._traced:
            problems.insert(0, f"no backend process maps {names} yet ({len(self._candidates)} processes checked); "
                               f"re-checking every {self.config.rescan_seconds:g}s")
        if problems:
            return CollectorStatus(CollectorState.DEGRADED, "; ".join(problems), self._last_ok_ts)
        symbols = sorted({s for t in self._traced.values() for s in t.symbols}, key=API_NAMES.index)
        return CollectorStatus(CollectorState.OK,
                               f"uprobes on {', '.join(symbols)} in {len(self._traced)} process(es)", self._last_ok_ts)

    def close(self) -> None:
        """Detach every probe and free the program; idempotent."""
        if self._closed:
            return
        self._closed = True
        self.program.close()


def attach_points() -> list[AttachNeed]:
    """The attach points of the cuda collector (``llmdiag doctor``): a uprobe and a uretprobe
    per exported allocation API of ``libcuda.so`` in each backend process."""
    return [
        AttachNeed("cuda", "uprobe", f"libcuda.so:{symbol}",
                   "allocations" if "Alloc" in symbol or "Create" in symbol else "frees", symbol in REQUIRED_SYMBOLS)
        for symbol, _ in PROBES
    ]


def build_cuda_collector(config: Config, backends: Sequence[Backend]) -> CudaAllocCollector:
    """The ``cuda`` collector for the agent; raises :class:`BPFUnavailable` when the kernel
    has no uprobes or the program cannot load (the wiring turns that into ``unavailable``)."""
    check_environment()  # first: without root or CAP_BPF, say that (with the way out)
    uprobes = features.uprobes_supported()
    if not uprobes:
        raise BPFUnavailable(uprobes.detail, "the CUDA allocation tracer needs CONFIG_UPROBE_EVENTS")
    return CudaAllocCollector(config.cuda, backends, proc_root=config.proc.proc_root)

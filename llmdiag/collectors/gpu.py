"""GPU collector: NVML device and process signals (SPEC 3.2 "gpu", 4 "gpu").

Per device (``Sample(Scope.GPU, "<NVML index>", ...)``):

=========================== ==================================================
``gpu_utilization``         0..1, mean of nvmlDeviceGetSamples since the last
                            tick (else nvmlDeviceGetUtilizationRates)
``gpu_utilization_peak``    0..1, max of those samples (NA without samples)
``memory_used_bytes``       nvmlDeviceGetMemoryInfo_v2 (v1 as fallback)
``memory_total_bytes``
``memory_reserved_bytes``   driver/firmware reservation (v2 only, else NA)
``process_memory_bytes``    Labelled ``{"pid=1234": bytes}`` (compute processes)
``power_watts``             nvmlDeviceGetPowerUsage (mW) / 1000
``temperature_celsius``     GPU core sensor
``sm_clock_hz``             nvmlDeviceGetClockInfo(SM) (MHz) * 1e6
``throttle_reasons``        Labelled ``{"reason=sw_power_cap": 1, ...}``: the
                            active clock-event reasons; ``{}`` = none active
``ecc_uncorrected_total``   volatile (since driver load) uncorrected ECC count
``xid_errors_total``        Labelled ``{"xid=79": 1}``, from the event thread
``pcie_rx_bytes_per_second`` / ``pcie_tx_bytes_per_second``: nvmlDeviceGetPcieThroughput
                            (KB/s * 1024), sampled every ``pcie_interval_seconds``
=========================== ==================================================

Per backend (``Sample(Scope.BACKEND, name, ...)``), for backends whose pid (or
an ancestor of the GPU process, e.g. vLLM's worker processes) is known:
``gpu_memory_bytes`` (sum over its processes and GPUs) and
``process_memory_bytes`` Labelled ``{"gpu=0,pid=1234": bytes}``.

A value the device cannot give is NA (JSON ``null``). A lost GPU
(NVML_ERROR_GPU_IS_LOST) gets all its signals NA and makes the collector
``degraded``; no NVML at all makes it ``unavailable`` with a hint.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from llmdiag.collectors.nvml import (
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_TIMEOUT,
    NVML_EVENT_TYPE_XID_CRITICAL_ERROR,
    GpuLost,
    Nvml,
    NvmlUnavailable,
    decode_clock_event_reasons,
    error_name,
)
from llmdiag.config import Config
from llmdiag.config.gpu import GpuConfig
from llmdiag.model import NA, Backend, CollectorState, CollectorStatus, Labelled, Sample, Scope, label_key

__all__ = ["DEVICE_SIGNALS", "GpuCollector", "build_gpu_collector"]

log = logging.getLogger(__name__)

#: NVML failures already logged by this process: one warning per cause, however many gpu
#: collectors (diagnose, demo, the agent's rebuilds) try.
_LOGGED_UNAVAILABLE: set[str] = set()


def _log_unavailable(exc: NvmlUnavailable) -> None:
    """No NVIDIA software at all is the normal state of a host without GPUs: the collector's
    status says so (with the hint) and the log only at info. A driver that is there but fails
    is a warning, once per process and cause."""
    if exc.absent:
        log.info("gpu collector unavailable: %s", exc)
        return
    if str(exc) not in _LOGGED_UNAVAILABLE:
        _LOGGED_UNAVAILABLE.add(str(exc))
        log.warning("gpu collector unavailable: %s", exc)

#: Every per-device signal name; a lost GPU reports each of them as NA.
DEVICE_SIGNALS = (
    "gpu_utilization",
    "gpu_utilization_peak",
    "memory_used_bytes",
    "memory_total_bytes",
    "memory_reserved_bytes",
    "process_memory_bytes",
    "power_watts",
    "temperature_celsius",
    "sm_clock_hz",
    "throttle_reasons",
    "ecc_uncorrected_total",
)

# nvmlValue_t union members by nvmlValueType_t (nvml.h).
_VALUE_FIELDS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}
_EVENT_WAIT_MS = 250
_ANCESTRY_DEPTH = 8


class GpuCollector:
    """NVML collector; see the module docstring for the signals.

    ``nvml`` is an :class:`Nvml` (real driver or a replay). ``pcie_in_thread``
    runs the slow PCIe calls in a background thread (default: with the real
    driver; inline with a replay, whose calls do not block).
    """

    name = "gpu"

    def __init__(
        self,
        nvml: Nvml,
        backends: Iterable[Backend] = (),
        *,
        proc_root: str | Path = "/proc",
        pcie_interval_seconds: float = 10.0,
        xid_events: bool = True,
        pcie_in_thread: bool | None = None,
        init_retry_seconds: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.nvml = nvml
        self.backends: list[Backend] = list(backends)
        self.proc_root = Path(proc_root)
        self.pcie_interval_seconds = pcie_interval_seconds
        self.xid_events = xid_events
        self.pcie_in_thread = (not nvml.is_replay) if pcie_in_thread is None else pcie_in_thread
        self.init_retry_seconds = init_retry_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._unavailable: NvmlUnavailable | None = None
        self._next_init = 0.0
        self._last_ok_ts: float | None = None
        self._lost: dict[int, str] = {}
        self._last_sample_us: dict[int, int] = {}
        self._pcie: dict[int, tuple[float, float]] = {}
        self._pcie_due = 0.0
        self._pcie_thread: threading.Thread | None = None
        self._event_thread: threading.Thread | None = None
        self._event_set: Any = None
        self._xid_registered: dict[int, bool] = {}
        self._xid_counts: dict[int, Labelled] = {}
        self._event_error: str | None = None
        self._ancestry: dict[int, str | None] = {}

    # -- construction ---------------------------------------------------------
    @classmethod
    def from_replay(cls, path: str | Path, backends: Iterable[Backend] = (), **kwargs: Any) -> GpuCollector:
        """A collector on recorded NVML answers (``llmdiag collect --nvml-replay FILE``).

        Raises :class:`~llmdiag.collectors.nvml_replay.ReplayError` for a file
        that is missing or not ``llmdiag.nvml-replay/v1``.
        """
        from llmdiag.collectors.nvml_replay import ReplayNvml  # noqa: PLC0415

        return cls(Nvml(ReplayNvml.from_file(path)), backends, **kwargs)

    @classmethod
    def from_config(cls, config: GpuConfig, backends: Iterable[Backend] = (), proc_root: str = "/proc") -> GpuCollector:
        kwargs: dict[str, Any] = {
            "proc_root": proc_root,
            "pcie_interval_seconds": config.pcie_interval_seconds,
            "xid_events": config.xid_events,
            "init_retry_seconds": config.init_retry_seconds,
        }
        if config.replay_file:
            return cls.from_replay(config.replay_file, backends, **kwargs)
        return cls(Nvml(), backends, **kwargs)

    def set_backends(self, backends: Iterable[Backend]) -> None:
        """Replace the backends whose processes get GPU memory attributed (after discovery)."""
        self.backends = list(backends)
        self._ancestry.clear()

    # -- lifecycle ------------------------------------------------------------
    def start(self) -> bool:
        """Initialise NVML and the background threads; False (with :meth:`status` saying why) when NVML is unusable."""
        if self.nvml.initialised:
            return True
        now = self._clock()
        if self._unavailable is not None and now < self._next_init:
            return False
        try:
            self.nvml.init()
        except NvmlUnavailable as exc:
            if self._unavailable is None or str(self._unavailable) != str(exc):
                _log_unavailable(exc)
            self._unavailable = exc
            self._next_init = now + self.init_retry_seconds
            return False
        self._unavailable = None
        self._stop.clear()
        if self.xid_events:
            self._start_events()
        if self.pcie_interval_seconds > 0 and self.pcie_in_thread:
            self._pcie_thread = threading.Thread(target=self._pcie_loop, name="llmdiag-nvml-pcie", daemon=True)
            self._pcie_thread.start()
        return True

    def close(self) -> None:
        """Stop the threads, free the event set, shut NVML down. Idempotent."""
        self._stop.set()
        stuck = []
        for thread in (self._event_thread, self._pcie_thread):
            if thread is not None:
                thread.join(timeout=5.0)
                if thread.is_alive():
                    stuck.append(thread.name)
        self._event_thread = self._pcie_thread = None
        if stuck:
            # A thread still inside nvmlEventSetWait (or a PCIe call): freeing the event set or
            # shutting NVML down under it is a use-after-free in the driver library. Leave both
            # to process exit; the threads are daemons.
            log.warning("gpu collector: %s did not stop within 5 s; leaving NVML open", ", ".join(stuck))
            return
        if self._event_set is not None:
            try:
                self.nvml.call("nvmlEventSetFree", self._event_set)
            except Exception as exc:  # noqa: BLE001
                log.debug("nvmlEventSetFree: %s", error_name(exc))
            self._event_set = None
        self.nvml.shutdown()

    # -- collection -----------------------------------------------------------
    def collect(self, now: float) -> list[Sample]:
        if not self.start():
            return []
        self.nvml.advance()
        samples: list[Sample] = []
        processes: dict[int, list[tuple[int, int]]] = {}  # pid -> [(gpu index, bytes)]
        for index in range(self.nvml.device_count):
            subject = str(index)
            try:
                signals = self._device_signals(index, processes)
            except GpuLost as exc:
                signals = dict.fromkeys(DEVICE_SIGNALS, NA)
                self._mark_lost(index, exc)
            else:
                with self._lock:
                    if self._lost.pop(index, None) is not None:
                        log.warning("GPU %d answers again", index)
            samples.extend(Sample(Scope.GPU, subject, name, value) for name, value in signals.items())
        if self.pcie_interval_seconds > 0:
            if not self.pcie_in_thread and now >= self._pcie_due:
                self._pcie_due = now + self.pcie_interval_seconds
                self._sample_pcie()
            samples.extend(self._pcie_samples())
        if self.xid_events:
            samples.extend(self._xid_samples())
        samples.extend(self._backend_samples(processes))
        self._last_ok_ts = now
        return samples

    def _device_signals(self, index: int, processes: dict[int, list[tuple[int, int]]]) -> dict[str, Any]:
        q = self.nvml.query
        out: dict[str, Any] = {}
        out["gpu_utilization"], out["gpu_utilization_peak"] = self._utilization(index)

        mem = q(index, "memory_v2")
        reserved: Any = NA
        if mem is NA:
            mem = q(index, "memory")
        else:
            reserved = int(mem.reserved)
        out["memory_used_bytes"] = NA if mem is NA else int(mem.used)
        out["memory_total_bytes"] = NA if mem is NA else int(mem.total)
        out["memory_reserved_bytes"] = reserved

        procs = q(index, "processes")
        if procs is NA:
            out["process_memory_bytes"] = NA
        else:
            per_pid = Labelled()
            for proc in procs:
                used = getattr(proc, "usedGpuMemory", None)
                if used is None:  # NVML_VALUE_NOT_AVAILABLE (WDDM, some MIG set-ups): unknown, not zero
                    continue
                per_pid.add(int(used), pid=str(proc.pid))
                processes.setdefault(int(proc.pid), []).append((index, int(used)))
            out["process_memory_bytes"] = per_pid

        power = q(index, "power")
        out["power_watts"] = NA if power is NA else power / 1000.0
        out["temperature_celsius"] = q(index, "temperature")
        clock = q(index, "sm_clock")
        out["sm_clock_hz"] = NA if clock is NA else clock * 1e6

        mask = q(index, "clock_events")
        if mask is NA:
            mask = q(index, "throttle")
        out["throttle_reasons"] = NA if mask is NA else _reasons(mask)
        out["ecc_uncorrected_total"] = q(index, "ecc_uncorrected")
        return out

    def _utilization(self, index: int) -> tuple[Any, Any]:
        """Mean and peak utilisation (0..1) of the driver's samples since the last tick."""
        got = self.nvml.query(index, "samples", self._last_sample_us.get(index, 0))
        if got is not NA:
            value_type, samples = got
            field = _VALUE_FIELDS.get(int(value_type))
            if field is not None and samples:
                values = [float(getattr(s.sampleValue, field)) for s in samples]
                self._last_sample_us[index] = max(int(s.timeStamp) for s in samples)
                return sum(values) / len(values) / 100.0, max(values) / 100.0
        # No samples newer than the last tick (or no sampling support): the
        # driver's own "percent of time busy over the last sample period".
        rates = self.nvml.query(index, "utilization")
        return (NA if rates is NA else rates.gpu / 100.0), NA

    def _mark_lost(self, index: int, exc: GpuLost) -> None:
        with self._lock:
            first = index not in self._lost
            self._lost[index] = str(exc)
            self._pcie.pop(index, None)
        self.nvml.forget_handle(index)
        if first:
            log.warning("%s", exc)

    # -- PCIe (slow calls) ------------------------------------------------------
    def _sample_pcie(self) -> None:
        for index in range(self.nvml.device_count):
            try:
                # KB/s per the NVML reference (nvmlDeviceGetPcieThroughput); 1 KB = 1024 B as nvidia-smi/nvitop use.
                rx = self.nvml.query(index, "pcie_rx")
                tx = self.nvml.query(index, "pcie_tx")
            except GpuLost as exc:
                self._mark_lost(index, exc)
                continue
            with self._lock:
                self._pcie[index] = (_kib(rx), _kib(tx))

    def _pcie_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._sample_pcie()
            except Exception as exc:  # noqa: BLE001 - a thread must not die silently
                log.warning("PCIe sampling failed: %s", error_name(exc))
            self._stop.wait(self.pcie_interval_seconds)

    def _pcie_samples(self) -> list[Sample]:
        with self._lock:
            pcie = dict(self._pcie)
            lost = set(self._lost)
        out = []
        for index in range(self.nvml.device_count):
            rx, tx = (NA, NA) if index in lost else pcie.get(index, (None, None))
            if rx is None:
                continue  # not sampled yet: absent, not zero
            out.append(Sample(Scope.GPU, str(index), "pcie_rx_bytes_per_second", rx))
            out.append(Sample(Scope.GPU, str(index), "pcie_tx_bytes_per_second", tx))
        return out

    # -- XID events -------------------------------------------------------------
    def _start_events(self) -> None:
        try:
            self._event_set = self.nvml.call("nvmlEventSetCreate")
        except Exception as exc:  # noqa: BLE001
            self._event_error = f"nvmlEventSetCreate: {error_name(exc)}"
            return
        for index in range(self.nvml.device_count):
            try:
                self.nvml.call("nvmlDeviceRegisterEvents", self.nvml.handle(index), NVML_EVENT_TYPE_XID_CRITICAL_ERROR, self._event_set)
            except Exception as exc:  # noqa: BLE001 - not supported on this device (or lost): its XIDs are NA
                self._xid_registered[index] = False
                log.info("no XID events from GPU %d: %s", index, error_name(exc))
            else:
                self._xid_registered[index] = True
                self._xid_counts[index] = Labelled()
        self._event_thread = threading.Thread(target=self._event_loop, name="llmdiag-nvml-xid", daemon=True)
        self._event_thread.start()

    def _event_loop(self) -> None:
        while not self._stop.is_set():
            try:
                event = self.nvml.call("nvmlEventSetWait", self._event_set, _EVENT_WAIT_MS)
            except Exception as exc:  # noqa: BLE001
                code = getattr(exc, "value", None)
                if code == NVML_ERROR_TIMEOUT:
                    continue
                if code != NVML_ERROR_GPU_IS_LOST:
                    self._event_error = f"nvmlEventSetWait: {error_name(exc)}"
                    log.warning("XID event thread: %s", self._event_error)
                self._stop.wait(1.0)  # do not spin on a persistent error
                continue
            if not int(event.eventType) & NVML_EVENT_TYPE_XID_CRITICAL_ERROR:
                continue
            try:
                index = int(self.nvml.call("nvmlDeviceGetIndex", event.device))
            except Exception as exc:  # noqa: BLE001
                log.warning("XID %d from an unknown device: %s", event.eventData, error_name(exc))
                continue
            log.warning("GPU %d reported XID %d", index, event.eventData)
            with self._lock:
                self._xid_counts.setdefault(index, Labelled()).add(1, xid=str(int(event.eventData)))

    def _xid_samples(self) -> list[Sample]:
        out = []
        with self._lock:
            for index in range(self.nvml.device_count):
                value: Any = Labelled(self._xid_counts[index]) if self._xid_registered.get(index) else NA
                out.append(Sample(Scope.GPU, str(index), "xid_errors_total", value))
        return out

    # -- per-backend attribution ---------------------------------------------------
    def _backend_samples(self, processes: dict[int, list[tuple[int, int]]]) -> list[Sample]:
        by_pid = {b.pid: b.name for b in self.backends if b.pid is not None}
        if not by_pid:
            return []
        per_backend: dict[str, Labelled] = {}
        for pid, uses in processes.items():
            owner = self._owner(pid, by_pid)
            if owner is None:
                continue
            for index, used in uses:
                per_backend.setdefault(owner, Labelled()).add(used, gpu=str(index), pid=str(pid))
        self._ancestry = {pid: owner for pid, owner in self._ancestry.items() if pid in processes}
        out = []
        for name, labelled in per_backend.items():
            out.append(Sample(Scope.BACKEND, name, "gpu_memory_bytes", labelled.total()))
            out.append(Sample(Scope.BACKEND, name, "process_memory_bytes", labelled))
        return out

    def _owner(self, pid: int, by_pid: dict[int, str]) -> str | None:
        """The backend whose pid is ``pid`` or one of its ancestors (tensor-parallel workers are children)."""
        if pid in self._ancestry:
            return self._ancestry[pid]
        owner = None
        current: int | None = pid
        for _ in range(_ANCESTRY_DEPTH):
            if current is None or current <= 1:
                break
            if current in by_pid:
                owner = by_pid[current]
                break
            current = _parent_pid(self.proc_root, current)
        self._ancestry[pid] = owner
        return owner

    # -- status -------------------------------------------------------------------
    def status(self) -> CollectorStatus:
        if self._unavailable is not None:
            exc = self._unavailable
            return CollectorStatus(CollectorState.UNAVAILABLE, f"{exc.reason}; hint: {exc.hint}", self._last_ok_ts)
        with self._lock:
            problems = [self._lost[i] for i in sorted(self._lost)]
        if self._event_error:
            problems.append(f"XID events: {self._event_error}")
        if problems:
            return CollectorStatus(CollectorState.DEGRADED, "; ".join(problems), self._last_ok_ts)
        return CollectorStatus(CollectorState.OK, None, self._last_ok_ts)


def _kib(value: Any) -> Any:
    return NA if value is NA else value * 1024.0


def _reasons(mask: int) -> Labelled:
    out = Labelled()
    for name in decode_clock_event_reasons(int(mask)):
        out[label_key(reason=name)] = 1
    return out


def _parent_pid(proc_root: Path, pid: int) -> int | None:
    try:
        with open(os.path.join(proc_root, str(pid), "stat"), "rb") as fh:
            text = fh.read()
        # comm (field 2) may hold spaces and ')': the fields after the last ')' are fixed.
        return int(text[text.rindex(b")") + 2 :].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def build_gpu_collector(config: Config, backends: list[Backend]) -> GpuCollector:
    """COLLECTOR_FACTORIES["gpu"]: the real NVML, or ``[gpu] replay_file`` when set."""
    return GpuCollector.from_config(config.gpu, backends, proc_root=config.proc.proc_root)

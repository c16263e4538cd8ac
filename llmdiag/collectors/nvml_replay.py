"""A pynvml stand-in that replays recorded NVML answers (``llmdiag.nvml-replay/v1``).

Development machines and CI have no GPU, so every GPU test runs the real
collector code against this object. It exposes the ``nvml*`` functions the
collector uses, returns pynvml's own types (``c_nvmlMemory_v2_t``,
``c_nvmlUtilization_t``, ``c_nvmlSample_t``, ``nvmlFriendlyObject``...) and
raises pynvml's own ``NVMLError`` subclasses, so the collector cannot tell it
from the driver.

File format (documented with examples in ``docs/gpu.md``)::

    {"format": "llmdiag.nvml-replay/v1",
     "provenance": "where these answers came from",
     "driver_version": "550.54.15",
     "init_error": null,                       # or "NVML_ERROR_LIBRARY_NOT_FOUND"...
     "devices": [{"name": "NVIDIA H200", "uuid": "GPU-..."}, ...],   # index = position
     "ticks": [
       {"nvmlDeviceGetUtilizationRates": {"*": {"gpu": 90, "memory": 40}, "3": {"error": "NVML_ERROR_NOT_SUPPORTED"}},
        "nvmlDeviceGetPcieThroughput.rx": {"0": 1048576},
        "events": [{"device": 3, "type": "xid", "data": 79}],
        "lost": [5]},
       ...]}

* Answer keys are :data:`llmdiag.collectors.nvml.QUERIES` keys. Under each, a
  device index (as a string) or ``"*"`` (every device without its own entry)
  maps to a value or to ``{"error": "NVML_ERROR_..."}``.
* Answers are sticky: a tick repeats the previous tick's answer for any key
  or device it does not mention. A tick that gives ``"*"`` for a key restates
  that key for every device (earlier per-device entries of the key are
  dropped). A key never given answers ``NVML_ERROR_NOT_SUPPORTED``.
* The replay starts before tick 0; each collector tick calls
  :meth:`ReplayNvml.replay_advance` first, so the first tick reads tick 0.
* ``lost``: devices for which every call in this tick (and later ticks, until
  a tick lists ``"found": [i]``) raises ``NVML_ERROR_GPU_IS_LOST``.
* ``events`` are delivered through ``nvmlEventSetWait`` once the collector
  reaches that tick, to event sets registered for that device and type.
* After the last tick the replay stays on it.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmdiag.collectors.base import CollectorUsageError
from llmdiag.collectors.nvml import (
    ERROR_CODES,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_TIMEOUT,
    NVML_EVENT_TYPE_XID_CRITICAL_ERROR,
    QUERIES,
    error_name,
    load_pynvml,
)

__all__ = ["REPLAY_FORMAT", "ReplayError", "ReplayFileError", "ReplayHandle", "ReplayNvml", "encode_answer", "record"]

REPLAY_FORMAT = "llmdiag.nvml-replay/v1"
EVENT_TYPES = {"xid": NVML_EVENT_TYPE_XID_CRITICAL_ERROR}


class ReplayError(ValueError):
    """A replay file that does not follow ``llmdiag.nvml-replay/v1``."""


class ReplayFileError(ReplayError, CollectorUsageError):
    """The replay file given cannot be used at all: missing, unreadable, not UTF-8 text
    (a binary file), not JSON, or not ``llmdiag.nvml-replay/v1``. The message names the file.
    A :class:`~llmdiag.collectors.base.CollectorUsageError`: ``--nvml-replay FILE`` exits 64."""


@dataclass(frozen=True, slots=True)
class ReplayHandle:
    """A device handle of the replay (the real one is an opaque C pointer)."""

    index: int


@dataclass(slots=True)
class ReplayEventData:
    """Shaped like pynvml's ``c_nvmlEventData_t``."""

    device: ReplayHandle
    eventType: int  # noqa: N815 - pynvml's field names
    eventData: int  # noqa: N815
    gpuInstanceId: int = 0xFFFFFFFF  # noqa: N815
    computeInstanceId: int = 0xFFFFFFFF  # noqa: N815


class _EventSet:
    def __init__(self) -> None:
        self.registered: dict[int, int] = {}  # device index -> event type mask
        self.queue: deque[ReplayEventData] = deque()
        self.cond = threading.Condition()
        self.freed = False


_BY_CALL = {(q.function, q.args): q.key for q in QUERIES.values()}


class ReplayNvml:
    """Replays one ``llmdiag.nvml-replay/v1`` document; see the module docstring."""

    is_replay = True

    def __init__(self, document: dict[str, Any], source: str = "<replay>") -> None:
        self._pynvml = load_pynvml()  # types and error classes only; the driver is never loaded
        self.source = source
        self._check(document)
        self.devices: list[dict[str, Any]] = list(document["devices"])
        self._ticks: list[dict[str, Any]] = list(document["ticks"])
        self._init_error = document.get("init_error")
        self._driver_version = document.get("driver_version", "replay")
        self._lock = threading.Lock()
        self._tick = -1
        self._answers: dict[str, dict[str, Any]] = {}
        self._lost: set[int] = set()
        self._event_sets: list[_EventSet] = []
        self.initialised = 0
        self.calls = 0

    @classmethod
    def from_file(cls, path: str | Path) -> ReplayNvml:
        p = Path(path)
        try:
            document = json.loads(p.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ReplayFileError(f"cannot read NVML replay {p}: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise ReplayFileError(f"NVML replay {p} is not text (binary at byte {exc.start}): want {REPLAY_FORMAT} JSON") from None
        except json.JSONDecodeError as exc:
            raise ReplayFileError(f"NVML replay {p} is not JSON: {exc}") from None
        try:
            return cls(document, source=str(p))
        except ReplayFileError:
            raise
        except ReplayError as exc:
            raise ReplayFileError(str(exc)) from None

    def _check(self, doc: Any) -> None:
        where = f"NVML replay {self.source}"
        if not isinstance(doc, dict) or doc.get("format") != REPLAY_FORMAT:
            raise ReplayError(f"{where}: want a JSON object with \"format\": \"{REPLAY_FORMAT}\"")
        if not isinstance(doc.get("devices"), list):
            raise ReplayError(f"{where}: 'devices' must be a list")
        ticks = doc.get("ticks")
        if not isinstance(ticks, list) or not ticks or not all(isinstance(t, dict) for t in ticks):
            raise ReplayError(f"{where}: 'ticks' must be a non-empty list of objects")
        known = {q.key for q in QUERIES.values()} | {"events", "lost", "found", "comment"}
        for n, tick in enumerate(ticks):
            unknown = set(tick) - known
            if unknown:
                raise ReplayError(f"{where}: tick {n} has unknown keys {sorted(unknown)}")
            for key, value in tick.items():
                if key in ("events", "lost", "found"):
                    if not isinstance(value, list):
                        raise ReplayError(f"{where}: tick {n} '{key}' must be a list")
                elif key != "comment" and not isinstance(value, dict):
                    raise ReplayError(f"{where}: tick {n} '{key}' must map device indices to answers")
            for event in tick.get("events", ()):
                if not (isinstance(event, dict) and isinstance(event.get("device"), int)
                        and isinstance(event.get("data"), int) and event.get("type", "xid") in EVENT_TYPES):
                    raise ReplayError(f"{where}: tick {n}: bad event {event!r} (want {{\"device\": 3, \"type\": \"xid\", \"data\": 79}})")
        init_error = doc.get("init_error")
        if init_error is not None and init_error not in ERROR_CODES:
            raise ReplayError(f"{where}: unknown init_error {init_error!r}")

    # -- the replay clock ---------------------------------------------------
    @property
    def tick(self) -> int:
        return self._tick

    def replay_advance(self) -> None:
        """Move to the next recorded tick (stays on the last one). The first call enters tick 0."""
        with self._lock:
            if self._tick + 1 < len(self._ticks):
                self._apply(self._tick + 1)

    def _apply(self, n: int) -> None:
        tick = self._ticks[n]
        self._tick = n
        for key, per_device in tick.items():
            if key in ("events", "lost", "found", "comment"):
                continue
            if not isinstance(per_device, dict):
                raise ReplayError(f"NVML replay {self.source}: tick {n} {key} must map devices to answers")
            if "*" in per_device:
                self._answers[key] = dict(per_device)  # "*" restates the key for every device
            else:
                self._answers.setdefault(key, {}).update(per_device)
        self._lost |= set(tick.get("lost", ()))
        self._lost -= set(tick.get("found", ()))
        for event in tick.get("events", ()):
            self._deliver(event, n)

    def _deliver(self, event: dict[str, Any], n: int) -> None:
        try:
            index = int(event["device"])
            etype = EVENT_TYPES[event.get("type", "xid")]
            data = int(event["data"])
        except (KeyError, TypeError, ValueError):
            raise ReplayError(f"NVML replay {self.source}: tick {n}: bad event {event!r}") from None
        for es in self._event_sets:
            if es.registered.get(index, 0) & etype:
                with es.cond:
                    es.queue.append(ReplayEventData(ReplayHandle(index), etype, data))
                    es.cond.notify_all()

    # -- errors ---------------------------------------------------------------
    def _raise(self, code: int) -> None:
        raise self._pynvml.NVMLError(code)

    def _answer(self, key: str, handle: ReplayHandle) -> Any:
        self.calls += 1
        if not self.initialised:
            self._raise(1)  # NVML_ERROR_UNINITIALIZED
        if not isinstance(handle, ReplayHandle):
            self._raise(NVML_ERROR_INVALID_ARGUMENT)
        with self._lock:
            if handle.index in self._lost:
                self._raise(NVML_ERROR_GPU_IS_LOST)
            per_device = self._answers.get(key, {})
            value = per_device.get(str(handle.index), per_device.get("*"))
        if value is None:
            self._raise(NVML_ERROR_NOT_SUPPORTED)
        if isinstance(value, dict) and "error" in value:
            code = ERROR_CODES.get(value["error"])
            if code is None:
                raise ReplayError(f"NVML replay {self.source}: unknown error {value['error']!r} for {key}")
            self._raise(code)
        return value

    # -- library -------------------------------------------------------------
    def nvmlInit(self) -> None:  # noqa: N802 - pynvml's names
        if self._init_error:
            self._raise(ERROR_CODES[self._init_error])
        self.initialised += 1

    def nvmlShutdown(self) -> None:  # noqa: N802
        if not self.initialised:
            self._raise(1)
        self.initialised -= 1

    def nvmlSystemGetDriverVersion(self) -> str:  # noqa: N802
        return str(self._driver_version)

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        if not self.initialised:
            self._raise(1)
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> ReplayHandle:  # noqa: N802
        if not 0 <= index < len(self.devices):
            self._raise(NVML_ERROR_INVALID_ARGUMENT)
        if index in self._lost:
            self._raise(NVML_ERROR_GPU_IS_LOST)
        return ReplayHandle(index)

    def nvmlDeviceGetIndex(self, handle: ReplayHandle) -> int:  # noqa: N802
        return handle.index

    def nvmlDeviceGetName(self, handle: ReplayHandle) -> str:  # noqa: N802
        return str(self.devices[handle.index].get("name", "replayed GPU"))

    def nvmlDeviceGetUUID(self, handle: ReplayHandle) -> str:  # noqa: N802
        return str(self.devices[handle.index].get("uuid", f"GPU-replay-{handle.index}"))

    # -- per-device queries (QUERIES) -------------------------------------------
    def nvmlDeviceGetUtilizationRates(self, handle: ReplayHandle) -> Any:  # noqa: N802
        v = self._answer("nvmlDeviceGetUtilizationRates", handle)
        return self._pynvml.c_nvmlUtilization_t(gpu=int(v["gpu"]), memory=int(v["memory"]))

    def nvmlDeviceGetSamples(self, handle: ReplayHandle, sampling_type: int, last_seen_us: int) -> Any:  # noqa: N802
        key = self._key("nvmlDeviceGetSamples", (sampling_type,))
        v = self._answer(key, handle)
        p = self._pynvml
        value_type = int(v.get("value_type", p.NVML_VALUE_TYPE_UNSIGNED_INT))
        field = _VALUE_FIELDS.get(value_type)
        if field is None:
            raise ReplayError(f"NVML replay {self.source}: unknown sample value_type {value_type}")
        out = []
        for ts, value in v.get("samples", ()):
            if ts > last_seen_us:
                sample = p.c_nvmlSample_t()
                sample.timeStamp = int(ts)
                setattr(sample.sampleValue, field, value)
                out.append(sample)
        if not out:
            self._raise(6)  # NVML_ERROR_NOT_FOUND: nothing newer than last_seen (as the driver answers)
        return (value_type, out)

    def nvmlDeviceGetMemoryInfo(self, handle: ReplayHandle, version: int | None = None) -> Any:  # noqa: N802
        p = self._pynvml
        if version:
            v = self._answer(self._key("nvmlDeviceGetMemoryInfo", (version,)), handle)
            mem = p.c_nvmlMemory_v2_t()
            mem.version = version
            mem.reserved = int(v["reserved"])
        else:
            v = self._answer("nvmlDeviceGetMemoryInfo", handle)
            mem = p.c_nvmlMemory_t()
        mem.total, mem.free, mem.used = int(v["total"]), int(v["free"]), int(v["used"])
        return mem

    def nvmlDeviceGetComputeRunningProcesses(self, handle: ReplayHandle) -> list[Any]:  # noqa: N802
        v = self._answer("nvmlDeviceGetComputeRunningProcesses", handle)
        out = []
        for proc in v:
            d = {"pid": int(proc["pid"]), "usedGpuMemory": proc.get("usedGpuMemory"),
                 "gpuInstanceId": proc.get("gpuInstanceId", 0xFFFFFFFF),
                 "computeInstanceId": proc.get("computeInstanceId", 0xFFFFFFFF)}
            out.append(self._pynvml.nvmlFriendlyObject(d))
        return out

    def nvmlDeviceGetPowerUsage(self, handle: ReplayHandle) -> int:  # noqa: N802
        return int(self._answer("nvmlDeviceGetPowerUsage", handle))

    def nvmlDeviceGetTemperature(self, handle: ReplayHandle, sensor: int) -> int:  # noqa: N802
        return int(self._answer(self._key("nvmlDeviceGetTemperature", (sensor,)), handle))

    def nvmlDeviceGetClockInfo(self, handle: ReplayHandle, clock: int) -> int:  # noqa: N802
        return int(self._answer(self._key("nvmlDeviceGetClockInfo", (clock,)), handle))

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: ReplayHandle) -> int:  # noqa: N802
        return int(self._answer("nvmlDeviceGetCurrentClocksEventReasons", handle))

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: ReplayHandle) -> int:  # noqa: N802
        return int(self._answer("nvmlDeviceGetCurrentClocksThrottleReasons", handle))

    def nvmlDeviceGetTotalEccErrors(self, handle: ReplayHandle, error_type: int, counter_type: int) -> int:  # noqa: N802
        return int(self._answer(self._key("nvmlDeviceGetTotalEccErrors", (error_type, counter_type)), handle))

    def nvmlDeviceGetPcieThroughput(self, handle: ReplayHandle, counter: int) -> int:  # noqa: N802
        return int(self._answer(self._key("nvmlDeviceGetPcieThroughput", (counter,)), handle))

    def _key(self, function: str, args: tuple[int, ...]) -> str:
        key = _BY_CALL.get((function, args))
        if key is None:
            # The collector asked for something outside the call list: a real
            # driver might answer, but the replay has nothing recorded.
            self._raise(NVML_ERROR_INVALID_ARGUMENT)
        return key  # type: ignore[return-value]

    # -- events ------------------------------------------------------------
    def nvmlEventSetCreate(self) -> _EventSet:  # noqa: N802
        es = _EventSet()
        with self._lock:
            self._event_sets.append(es)
        return es

    def nvmlDeviceRegisterEvents(self, handle: ReplayHandle, event_types: int, event_set: _EventSet) -> None:  # noqa: N802
        if handle.index in self._lost:
            self._raise(NVML_ERROR_GPU_IS_LOST)
        unsupported = self.devices[handle.index].get("events_unsupported", False)
        if unsupported:
            self._raise(NVML_ERROR_NOT_SUPPORTED)
        event_set.registered[handle.index] = event_set.registered.get(handle.index, 0) | int(event_types)

    def nvmlEventSetWait(self, event_set: _EventSet, timeout_ms: int) -> ReplayEventData:  # noqa: N802
        with event_set.cond:
            if not event_set.queue:
                event_set.cond.wait(timeout_ms / 1000.0)
            if event_set.freed or not event_set.queue:
                self._raise(NVML_ERROR_TIMEOUT)
            return event_set.queue.popleft()

    def nvmlEventSetFree(self, event_set: _EventSet) -> None:  # noqa: N802
        with event_set.cond:
            event_set.freed = True
            event_set.cond.notify_all()
        with self._lock:
            if event_set in self._event_sets:
                self._event_sets.remove(event_set)


_VALUE_FIELDS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


# -- recording ---------------------------------------------------------------------
def encode_answer(value: Any) -> Any:
    """One NVML answer (pynvml struct, sample tuple, process list, int) as replay JSON."""
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], list):
        value_type, samples = value
        field = _VALUE_FIELDS.get(int(value_type), "uiVal")
        return {"value_type": int(value_type),
                "samples": [[int(s.timeStamp), getattr(s.sampleValue, field)] for s in samples]}
    if isinstance(value, list):
        return [encode_answer(v) for v in value]
    fields = getattr(value, "_fields_", None)
    if fields is not None:  # a ctypes struct: its named fields
        return {name: encode_answer(getattr(value, name)) for name, *_ in fields}
    if hasattr(value, "__dict__") and not isinstance(value, (int, float, str)):  # nvmlFriendlyObject
        return {k: encode_answer(v) for k, v in vars(value).items()}
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value


def record(
    library: Any,
    ticks: int,
    interval_seconds: float,
    provenance: str,
    progress: Any = None,
) -> dict[str, Any]:
    """Record ``ticks`` ticks of every :data:`QUERIES` call on every device, plus XID events.

    ``library`` is the real ``pynvml`` (or anything pynvml-like). Between
    ticks the recorder waits on an XID event set for ``interval_seconds``, so
    events land in the tick after they happened, as the collector sees them.
    """
    library.nvmlInit()
    try:
        count = int(library.nvmlDeviceGetCount())
        handles = [library.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        devices = []
        for h in handles:
            devices.append({"name": encode_answer(library.nvmlDeviceGetName(h)),
                            "uuid": encode_answer(library.nvmlDeviceGetUUID(h))})
        event_set = library.nvmlEventSetCreate()
        for i, h in enumerate(handles):
            try:
                library.nvmlDeviceRegisterEvents(h, NVML_EVENT_TYPE_XID_CRITICAL_ERROR, event_set)
            except Exception:  # noqa: BLE001
                devices[i]["events_unsupported"] = True
        last_sample_us = [0] * count
        recorded = []
        pending_events: list[dict[str, Any]] = []
        advance = getattr(library, "replay_advance", None)  # re-recording a replay (tests); absent in pynvml
        for n in range(ticks):
            if advance is not None:
                advance()
            tick: dict[str, Any] = {}
            if pending_events:
                tick["events"], pending_events = pending_events, []
            for q in QUERIES.values():
                per_device: dict[str, Any] = {}
                for i, h in enumerate(handles):
                    extra = (last_sample_us[i],) if q.key == "nvmlDeviceGetSamples" else ()
                    try:
                        value = getattr(library, q.function)(h, *q.args, *extra)
                    except Exception as exc:  # noqa: BLE001 - NVML errors are answers too
                        per_device[str(i)] = {"error": error_name(exc)}
                        continue
                    if q.key == "nvmlDeviceGetSamples" and value[1]:
                        last_sample_us[i] = max(int(s.timeStamp) for s in value[1])
                    per_device[str(i)] = encode_answer(value)
                tick[q.key] = per_device
            recorded.append(tick)
            if progress is not None:
                progress(n + 1, ticks)
            deadline = time.monotonic() + interval_seconds
            while (left := deadline - time.monotonic()) > 0:
                try:
                    event = library.nvmlEventSetWait(event_set, max(1, int(left * 1000)))
                except Exception:  # noqa: BLE001 - timeout (or an error): the interval is over
                    break
                index = int(library.nvmlDeviceGetIndex(event.device))
                pending_events.append({"device": index, "type": "xid", "data": int(event.eventData)})
        try:
            library.nvmlEventSetFree(event_set)
        except Exception:  # noqa: BLE001
            pass
        driver = library.nvmlSystemGetDriverVersion()
    finally:
        library.nvmlShutdown()
    return {
        "format": REPLAY_FORMAT,
        "provenance": provenance,
        "driver_version": encode_answer(driver),
        "init_error": None,
        "devices": devices,
        "ticks": recorded,
    }

"""The one module that owns ``pynvml`` (the ``nvidia-ml-py`` package).

Everything else talks NVML through :class:`Nvml`:

* **lazy init**: nothing touches the driver until :meth:`Nvml.init` (the GPU
  collector calls it on its first tick); a missing ``pynvml`` module,
  ``libnvidia-ml.so.1`` or kernel driver becomes :class:`NvmlUnavailable`
  with a reason and a hint, never an import-time crash;
* **one guarded choke point**, :meth:`Nvml.query`: every per-device call goes
  through it. ``NVML_ERROR_NOT_SUPPORTED`` and its friends (no permission,
  function not found in an older driver, no data yet...) come back as
  :data:`~llmdiag.model.NA`, so callers need no ``if supported:`` ladders;
  ``NVML_ERROR_GPU_IS_LOST`` (the GPU fell off the bus, XID 79) raises
  :class:`GpuLost` so the collector can mark that one device lost;
* **one call list**, :data:`QUERIES`: the collector, the recording script
  (``bench/record_nvml.py``) and the replay backend
  (:mod:`llmdiag.collectors.nvml_replay`) all use it, so a recording holds
  exactly the answers the collector asks for.

The library object behind :class:`Nvml` is the real ``pynvml`` module or a
:class:`~llmdiag.collectors.nvml_replay.ReplayNvml`; both expose the same
``nvml*`` functions and raise ``pynvml.NVMLError`` subclasses.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmdiag.model import NA

__all__ = [
    "CLOCK_EVENT_REASONS",
    "QUERIES",
    "GpuLost",
    "Nvml",
    "NvmlProbe",
    "NvmlQuery",
    "NvmlUnavailable",
    "decode_clock_event_reasons",
    "error_name",
    "probe_nvml",
    "load_pynvml",
]

log = logging.getLogger(__name__)

# pynvml constants, copied so that the call list can be built without
# importing pynvml (they are part of NVML's stable ABI, nvml.h).
NVML_GPU_UTILIZATION_SAMPLES = 1
NVML_CLOCK_SM = 1
NVML_TEMPERATURE_GPU = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_PCIE_UTIL_TX_BYTES = 0
NVML_PCIE_UTIL_RX_BYTES = 1
#: ``nvmlMemory_v2`` = sizeof(nvmlMemory_v2_t) | 2 << 24, the struct version of nvmlDeviceGetMemoryInfo_v2.
NVML_MEMORY_V2 = 0x2000028
NVML_EVENT_TYPE_XID_CRITICAL_ERROR = 0x8

NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_NO_DATA = 21
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25

#: Errors that mean "this device cannot give this value": the value is NA.
#: NOT_FOUND is what nvmlDeviceGetSamples answers when no sample is newer than
#: the timestamp asked for; FUNCTION_NOT_FOUND / ARGUMENT_VERSION_MISMATCH come
#: from drivers older than the pynvml binding (e.g. no *_v2 memory info).
NA_ERRORS = frozenset(
    {
        NVML_ERROR_NOT_SUPPORTED,
        NVML_ERROR_NO_PERMISSION,
        NVML_ERROR_NOT_FOUND,
        NVML_ERROR_FUNCTION_NOT_FOUND,
        NVML_ERROR_NO_DATA,
        NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
    }
)


@dataclass(frozen=True, slots=True)
class NvmlQuery:
    """One per-device NVML call: ``function(handle, *args)``.

    ``key`` names its answers in a replay file; it is the function name, with
    a ``.suffix`` where one function is called with different arguments.
    """

    key: str
    function: str
    args: tuple[int, ...] = ()


#: Every per-device call the GPU collector makes, by role. The recorder and the
#: replay backend use this table too.
QUERIES: dict[str, NvmlQuery] = {
    "samples": NvmlQuery("nvmlDeviceGetSamples", "nvmlDeviceGetSamples", (NVML_GPU_UTILIZATION_SAMPLES,)),
    "utilization": NvmlQuery("nvmlDeviceGetUtilizationRates", "nvmlDeviceGetUtilizationRates"),
    "memory_v2": NvmlQuery("nvmlDeviceGetMemoryInfo_v2", "nvmlDeviceGetMemoryInfo", (NVML_MEMORY_V2,)),
    "memory": NvmlQuery("nvmlDeviceGetMemoryInfo", "nvmlDeviceGetMemoryInfo"),
    "processes": NvmlQuery("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetComputeRunningProcesses"),
    "power": NvmlQuery("nvmlDeviceGetPowerUsage", "nvmlDeviceGetPowerUsage"),
    "temperature": NvmlQuery("nvmlDeviceGetTemperature", "nvmlDeviceGetTemperature", (NVML_TEMPERATURE_GPU,)),
    "sm_clock": NvmlQuery("nvmlDeviceGetClockInfo.sm", "nvmlDeviceGetClockInfo", (NVML_CLOCK_SM,)),
    "clock_events": NvmlQuery("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksEventReasons"),
    # Drivers before 535 only have the older name of the same bitmask.
    "throttle": NvmlQuery("nvmlDeviceGetCurrentClocksThrottleReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"),
    "ecc_uncorrected": NvmlQuery(
        "nvmlDeviceGetTotalEccErrors.uncorrected_volatile",
        "nvmlDeviceGetTotalEccErrors",
        (NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC),
    ),
    "pcie_rx": NvmlQuery("nvmlDeviceGetPcieThroughput.rx", "nvmlDeviceGetPcieThroughput", (NVML_PCIE_UTIL_RX_BYTES,)),
    "pcie_tx": NvmlQuery("nvmlDeviceGetPcieThroughput.tx", "nvmlDeviceGetPcieThroughput", (NVML_PCIE_UTIL_TX_BYTES,)),
}

#: Clock-event ("throttle") reason bits (nvml.h ``nvmlClocksEventReason*``, the
#: older ``nvmlClocksThrottleReason*`` share the values) -> snake_case names.
CLOCK_EVENT_REASONS: dict[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


def decode_clock_event_reasons(mask: int) -> list[str]:
    """``0x44`` -> ``["sw_power_cap", "hw_thermal_slowdown"]``; unknown bits become ``unknown_0x...``."""
    names = []
    bit = 1
    while bit <= mask:
        if mask & bit:
            names.append(CLOCK_EVENT_REASONS.get(bit, f"unknown_{bit:#x}"))
        bit <<= 1
    return names


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used on this host; ``hint`` says what to do about it. ``absent`` is True
    when there is no NVIDIA software here at all (no libnvidia-ml, no pynvml): the normal
    state of a host without GPUs, not a fault."""

    def __init__(self, reason: str, hint: str, absent: bool = False) -> None:
        super().__init__(f"{reason} ({hint})")
        self.reason = reason
        self.hint = hint
        self.absent = absent


class GpuLost(RuntimeError):
    """NVML_ERROR_GPU_IS_LOST on one device (it fell off the bus; XID 79)."""

    def __init__(self, index: int, call: str) -> None:
        super().__init__(f"GPU {index} is lost (NVML_ERROR_GPU_IS_LOST from {call})")
        self.index = index
        self.call = call


def load_pynvml() -> Any:
    """Import the real ``pynvml``; :class:`NvmlUnavailable` with a hint when it is not installed."""
    try:
        import pynvml  # noqa: PLC0415 - lazily, so that hosts without it still import llmdiag
    except ImportError as exc:
        raise NvmlUnavailable(f"pynvml is not importable: {exc}", "pip install nvidia-ml-py", absent=True) from None
    return pynvml


def error_name(exc: BaseException) -> str:
    """``NVML_ERROR_NOT_SUPPORTED`` for an NVMLError, the exception text otherwise."""
    code = getattr(exc, "value", None)
    if isinstance(code, int):
        return _ERROR_NAMES.get(code, f"NVML_ERROR_{code}")
    return f"{type(exc).__name__}: {exc}"


_ERROR_NAMES = {
    1: "NVML_ERROR_UNINITIALIZED",
    2: "NVML_ERROR_INVALID_ARGUMENT",
    NVML_ERROR_NOT_SUPPORTED: "NVML_ERROR_NOT_SUPPORTED",
    NVML_ERROR_NO_PERMISSION: "NVML_ERROR_NO_PERMISSION",
    6: "NVML_ERROR_NOT_FOUND",
    7: "NVML_ERROR_INSUFFICIENT_SIZE",
    NVML_ERROR_DRIVER_NOT_LOADED: "NVML_ERROR_DRIVER_NOT_LOADED",
    NVML_ERROR_TIMEOUT: "NVML_ERROR_TIMEOUT",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML_ERROR_LIBRARY_NOT_FOUND",
    NVML_ERROR_FUNCTION_NOT_FOUND: "NVML_ERROR_FUNCTION_NOT_FOUND",
    14: "NVML_ERROR_CORRUPTED_INFOROM",
    NVML_ERROR_GPU_IS_LOST: "NVML_ERROR_GPU_IS_LOST",
    16: "NVML_ERROR_RESET_REQUIRED",
    17: "NVML_ERROR_OPERATING_SYSTEM",
    18: "NVML_ERROR_LIB_RM_VERSION_MISMATCH",
    NVML_ERROR_NO_DATA: "NVML_ERROR_NO_DATA",
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH: "NVML_ERROR_ARGUMENT_VERSION_MISMATCH",
    999: "NVML_ERROR_UNKNOWN",
}
ERROR_CODES = {name: code for code, name in _ERROR_NAMES.items()}

_INIT_HINTS = {
    NVML_ERROR_LIBRARY_NOT_FOUND: "libnvidia-ml.so.1 not found: install the NVIDIA driver, or run the container "
    "with the NVIDIA runtime (--gpus / nvidia.com/gpu)",
    NVML_ERROR_DRIVER_NOT_LOADED: "the NVIDIA kernel driver is not loaded: check `nvidia-smi` and `lsmod | grep nvidia`",
    18: "driver/library version mismatch: reboot or reload the nvidia kernel module",
    NVML_ERROR_NO_PERMISSION: "no permission to open /dev/nvidia*: run as root or in the video group",
}


class Nvml:
    """NVML behind one choke point.

    ``library`` is a pynvml-like object (the real module or a replay); ``None``
    imports ``pynvml`` at :meth:`init`. The object is thread-safe in the sense
    NVML is: calls may come from the collector and the XID event thread.
    """

    def __init__(self, library: Any = None) -> None:
        self._library = library
        self._lib: Any = None
        self._handles: dict[int, Any] = {}
        self._lock = threading.Lock()
        self.initialised = False
        self.device_count = 0
        self.driver_version: str | None = None
        #: (device index, query key) -> NVML error name, for the calls that answered NA.
        self.na_causes: dict[tuple[int, str], str] = {}

    @property
    def is_replay(self) -> bool:
        return bool(getattr(self._library, "is_replay", False))

    @property
    def lib(self) -> Any:
        if self._lib is None:
            raise NvmlUnavailable("NVML is not initialised", "call Nvml.init() first")
        return self._lib

    def init(self) -> None:
        """Load and initialise NVML once; :class:`NvmlUnavailable` says why not."""
        with self._lock:
            if self.initialised:
                return
            lib = self._library if self._library is not None else load_pynvml()
            try:
                lib.nvmlInit()
            except Exception as exc:  # noqa: BLE001 - NVMLError, or OSError from a broken library
                code = getattr(exc, "value", None)
                hint = _INIT_HINTS.get(code, "check `nvidia-smi`; NVML must work for the user running llmdiag")
                absent = code == NVML_ERROR_LIBRARY_NOT_FOUND
                raise NvmlUnavailable(f"nvmlInit failed: {error_name(exc)}", hint, absent=absent) from None
            try:
                self.device_count = int(lib.nvmlDeviceGetCount())
                self.driver_version = _text(self._guard(lib.nvmlSystemGetDriverVersion))
            except Exception as exc:  # noqa: BLE001
                _quiet(lib.nvmlShutdown)
                raise NvmlUnavailable(f"NVML answers but cannot count devices: {error_name(exc)}", "check `nvidia-smi`") from None
            self._lib = lib
            self.initialised = True

    def shutdown(self) -> None:
        with self._lock:
            if self.initialised:
                _quiet(self._lib.nvmlShutdown)
            self.initialised = False
            self._handles.clear()

    def advance(self) -> None:
        """Start a new tick. The real NVML has no ticks; a replay moves to its next recorded tick."""
        advance = getattr(self._lib, "replay_advance", None)
        if advance is not None:
            advance()

    def handle(self, index: int) -> Any:
        """The device handle; raises :class:`GpuLost` when the device cannot be opened because it is lost."""
        handle = self._handles.get(index)
        if handle is None:
            try:
                handle = self.lib.nvmlDeviceGetHandleByIndex(index)
            except Exception as exc:  # noqa: BLE001
                if getattr(exc, "value", None) == NVML_ERROR_GPU_IS_LOST:
                    raise GpuLost(index, "nvmlDeviceGetHandleByIndex") from None
                raise
            self._handles[index] = handle
        return handle

    def forget_handle(self, index: int) -> None:
        self._handles.pop(index, None)

    def query(self, index: int, role: str, *extra: Any) -> Any:
        """Run ``QUERIES[role]`` on device ``index``: its answer, or NA when the device cannot give it.

        ``extra`` arguments follow the fixed ones (``nvmlDeviceGetSamples``'s
        last-seen timestamp). Raises :class:`GpuLost` for a lost GPU; other
        NVML errors (unknown, timeout, ...) also come back as NA, but are
        remembered in :attr:`na_causes` so the status can name them.
        """
        q = QUERIES[role]
        fn = getattr(self.lib, q.function, None)
        if fn is None:
            self.na_causes[(index, q.key)] = "NVML_ERROR_FUNCTION_NOT_FOUND"
            return NA
        try:
            value = fn(self.handle(index), *q.args, *extra)
        except GpuLost:
            raise
        except Exception as exc:  # noqa: BLE001 - the choke point
            code = getattr(exc, "value", None)
            if code == NVML_ERROR_GPU_IS_LOST:
                raise GpuLost(index, q.key) from None
            cause = error_name(exc)
            if code is None and self.na_causes.get((index, q.key)) != cause:
                # Not an NVMLError at all (a binding bug, a malformed replay): still NA, but say so once.
                log.warning("NVML %s on GPU %d raised %s", q.key, index, cause)
            self.na_causes[(index, q.key)] = cause
            return NA
        self.na_causes.pop((index, q.key), None)
        return value

    def call(self, function: str, *args: Any) -> Any:
        """A non-device call (event sets, index of a handle); NVML errors propagate."""
        return getattr(self.lib, function)(*args)

    @staticmethod
    def _guard(fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001
            if getattr(exc, "value", None) in NA_ERRORS:
                return NA
            raise


def _text(value: Any) -> str | None:
    if value is NA or value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def _quiet(fn: Callable[[], Any]) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - best effort on the way out
        pass


@dataclass(frozen=True, slots=True)
class NvmlProbe:
    """What ``llmdiag doctor`` says about NVML: whether it starts, the driver, the GPUs, and
    otherwise why not with a hint (``absent``: no NVIDIA software here at all)."""

    ok: bool
    driver_version: str | None = None
    device_count: int = 0
    reason: str | None = None
    hint: str | None = None
    absent: bool = False


def probe_nvml(library: Any = None) -> NvmlProbe:
    """Start NVML once, read the driver version and GPU count, shut it down. Never raises.

    The one way the rest of llmdiag (``doctor``) asks about NVML: this module owns pynvml.
    ``library`` is a pynvml-like object (a replay in tests); ``None`` is the real one."""
    nvml = Nvml(library)
    try:
        nvml.init()
    except NvmlUnavailable as exc:
        return NvmlProbe(False, reason=exc.reason, hint=exc.hint, absent=exc.absent)
    except Exception as exc:  # noqa: BLE001 - a broken library must not crash doctor
        return NvmlProbe(False, reason=f"NVML failed: {type(exc).__name__}: {exc}", hint="check `nvidia-smi`")
    try:
        return NvmlProbe(True, driver_version=nvml.driver_version, device_count=nvml.device_count)
    finally:
        nvml.shutdown()

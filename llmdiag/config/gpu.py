"""``[gpu]`` (NVML collector) and ``[proc]`` (/proc and PSI collector) sections."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GpuConfig", "ProcConfig"]


@dataclass(frozen=True)
class GpuConfig:
    #: Replay recorded NVML answers from this file instead of the driver
    #: (``llmdiag.nvml-replay/v1``, see docs/gpu.md); "" = the real NVML.
    replay_file: str = ""
    #: Seconds between PCIe throughput samples. Each nvmlDeviceGetPcieThroughput
    #: call blocks ~20 ms in the driver, two per GPU, so they run on their own
    #: slower cadence (in a background thread with the real driver). 0 disables them.
    pcie_interval_seconds: float = 10.0
    #: Count XID critical errors through an NVML event set in a background thread.
    xid_events: bool = True
    #: Seconds between retries of nvmlInit after it failed (driver not loaded yet...).
    init_retry_seconds: float = 30.0

    def __post_init__(self) -> None:
        if self.pcie_interval_seconds < 0:
            raise ValueError(f"pcie_interval_seconds must be >= 0 (0 = off), got {self.pcie_interval_seconds}")
        if self.init_retry_seconds <= 0:
            raise ValueError(f"init_retry_seconds must be > 0, got {self.init_retry_seconds}")


@dataclass(frozen=True)
class ProcConfig:
    #: Root of the proc filesystem (a container with the host's /proc mounted elsewhere sets it).
    proc_root: str = "/proc"
    #: Count D-state (uninterruptible) threads of each backend from /proc/PID/task/*/stat.
    dstate_threads: bool = True
    #: At most this many threads (lowest tids first) are read per process and tick: each
    #: /proc/PID/task/TID/stat read costs ~10 us, so this bounds the tick on huge thread pools.
    max_threads_per_process: int = 512
    #: The D-state thread scan runs every N ticks (1 = every tick); in between, ``threads_dstate``
    #: repeats the last count. It costs one read per thread: every 2nd tick halves it on engines
    #: with hundreds of threads, and two scans still stand behind the io_blocking rule's 3 s hold.
    dstate_every_ticks: int = 2
    #: /proc/PID/smaps_rollup (``mapped_file_bytes``, ``swap_bytes``) is read every N ticks and
    #: repeated in between: the kernel walks every mapping of the process to answer (~1.6 ms for
    #: a small Python process, more for an engine with GBs mapped), and no rule reads these signals.
    smaps_rollup_every_ticks: int = 60

    def __post_init__(self) -> None:
        if not self.proc_root:
            raise ValueError("proc_root must not be empty")
        for key in ("dstate_every_ticks", "smaps_rollup_every_ticks"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1 (1 = every tick), got {getattr(self, key)}")
        if self.max_threads_per_process < 1:
            raise ValueError(f"max_threads_per_process must be >= 1, got {self.max_threads_per_process}")

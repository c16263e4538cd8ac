"""``[cuda]``: the CUDA allocation tracer (uprobes on libcuda.so, docs/cuda_tracer.md)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CudaConfig"]


@dataclass(frozen=True)
class CudaConfig:
    #: A mapping in /proc/PID/maps whose file name starts with one of these is the
    #: CUDA driver library (``libcuda.so``, ``libcuda.so.1``, ``libcuda.so.550.54.15``;
    #: not ``libcudart.so``, the runtime, which calls into it).
    library_names: tuple[str, ...] = ("libcuda.so",)
    #: Also trace the descendants of each backend pid. Engines allocate in child
    #: processes (vLLM's engine core and tensor-parallel workers, SGLang's schedulers),
    #: not in the API server whose pid discovery finds; their counts go to the backend.
    include_children: bool = True
    #: Seconds between looks for backend processes that have newly mapped libcuda
    #: (engines load it at CUDA initialisation, well after start-up).
    rescan_seconds: float = 5.0
    #: Traced processes the BPF maps have room for.
    max_pids: int = 1024
    #: Live allocations remembered (pointer -> size) across all traced processes. When
    #: full, further allocations are counted but not tracked (outstanding bytes under-count,
    #: shown by cuda_tracer_map_full_total).
    max_live_allocations: int = 65536

    def __post_init__(self) -> None:
        if not self.library_names or any(not n or "/" in n for n in self.library_names):
            raise ValueError(f"library_names must be non-empty file names, got {list(self.library_names)!r}")
        if not self.rescan_seconds > 0:
            raise ValueError(f"rescan_seconds must be > 0, got {self.rescan_seconds}")
        if not 1 <= self.max_pids <= 65536:
            raise ValueError(f"max_pids must be 1..65536, got {self.max_pids}")
        if not 64 <= self.max_live_allocations <= 4_194_304:
            raise ValueError(f"max_live_allocations must be 64..4194304, got {self.max_live_allocations}")

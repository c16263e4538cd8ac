"""GPU and host rules: memory pressure, faults, throttling, idle GPUs with a queue, IO stalls."""

from __future__ import annotations

import re
from collections.abc import Iterable

from llmdiag.analyzers.context import Context, number
from llmdiag.analyzers.rules.base import Rule, Verdict, bar, ev, reads
from llmdiag.config.analyzers import (
    GpuFaultConfig,
    GpuIdleWithQueueConfig,
    GpuMemoryPressureConfig,
    GpuThrottlingConfig,
    IoBlockingConfig,
)
from llmdiag.collectors.nvml import CLOCK_EVENT_REASONS
from llmdiag.model import HOST, Evidence, Labelled, Severity

__all__ = ["GpuFault", "GpuIdleWithQueue", "GpuMemoryPressure", "GpuThrottling", "IoBlocking", "throttle_names"]

# Reasons that cost throughput; idle, app clocks, sync boost and display clocks are normal.
_HARMFUL = {"sw_power_cap", "hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"}
_HW = {"hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"}


def _norm(name: str) -> str:
    # "HwThermalSlowdown", "hw-thermal-slowdown" and "hw_thermal_slowdown" all mean the same reason.
    name = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name.strip())
    name = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    return name.removeprefix("clocks_event_reason_").removeprefix("clocks_throttle_reason_")


def throttle_names(value: object) -> set[str]:
    """Active reasons from ``throttle_reasons``: a labelled signal ``{"reason=hw_slowdown": 1}``
    or the raw NVML bitmask as a number."""
    if isinstance(value, Labelled):
        out = set()
        for key, v in value.items():
            if v:
                out.add(_norm(key.partition("=")[2] if "=" in key else key))
        return out
    mask_value = number(value)  # NA (a lost GPU) and NaN are "unknown", never a mask
    if mask_value is not None:
        mask = int(mask_value)
        return {name for bit, name in CLOCK_EVENT_REASONS.items() if mask & bit}
    return set()


def _gpu_subjects(ctx: Context) -> list[tuple[str, tuple[str, ...]]]:
    """(subject, gpus): each backend with its GPUs, then ``host`` with the GPUs no backend claims."""
    out = []
    claimed: set[str] = set()
    for b in ctx.backends:
        gpus = ctx.gpus_for(b)
        if gpus:
            out.append((b, gpus))
            claimed.update(gpus)
    for g in sorted(ctx.snapshot.gpus):
        if g not in claimed:
            out.append((HOST, (g,)))
    return out


class GpuMemoryPressure(Rule[GpuMemoryPressureConfig]):
    """CUDA allocation failures or allocator OOMs (alone), allocator fragmentation
    (inactive_split / reserved) >= fragmentation_enter, or NVML memory used >= used_enter
    together with allocator retries. NVML memory alone never fires: engines preallocate."""

    kind = "gpu_memory_pressure"
    history = reads("b", "cuda_alloc_failures_total", "allocator_ooms_total", "allocator_alloc_retries_total")
    remediation = "Restart with a lower gpu_memory_utilization (or fewer max_num_seqs); drain to defragment."

    def evaluate(self, ctx: Context) -> Iterable[Verdict]:
        cfg = self.config
        w = cfg.event_window_seconds
        subjects = _gpu_subjects(ctx)
        seen = {s for s, _ in subjects}
        subjects += [(b, ()) for b in ctx.backends if b not in seen]
        for subject, gpus in subjects:
            key = "" if subject != HOST else ",".join(gpus)
            used = None
            used_gpu = None
            failures = None
            for g in gpus:
                total, mem = ctx.gpu(g, "memory_total_bytes"), ctx.gpu(g, "memory_used_bytes")
                if total and mem is not None and (used is None or mem / total > used):
                    used, used_gpu = mem / total, g
            # cuda_alloc_failures_total is per backend (the cuda tracer attributes by process);
            # no collector gives it per GPU, so host-owned GPUs have no failure count.
            ooms = retries = frag = None
            if subject != HOST:
                inc = ctx.increase("b", subject, "cuda_alloc_failures_total", w)
                if inc is not None:
                    failures = (failures or 0.0) + inc
                ooms = ctx.increase("b", subject, "allocator_ooms_total", w)
                retries = ctx.increase("b", subject, "allocator_alloc_retries_total", w)
                reserved = ctx.backend(subject, "allocator_reserved_bytes")
                split = ctx.backend(subject, "allocator_inactive_split_bytes")
                if reserved and split is not None:
                    frag = split / reserved
            if used is None and failures is None and ooms is None and retries is None and frag is None:
                yield subject, key, None
                continue
            oom = bool(failures) or bool(ooms)
            fragmented = frag is not None and frag >= cfg.fragmentation_enter
            retrying_full = bool(retries) and used is not None and used >= cfg.used_enter
            enter = oom or fragmented or retrying_full
            stay = oom or (frag is not None and frag >= 0.8 * cfg.fragmentation_enter) or (bool(retries) and used is not None and used >= cfg.used_exit)
            evidence = []
            if used is not None:
                evidence.append(ev(f"gpus[{used_gpu}].memory_used_bytes / memory_total_bytes", used, bar(enter, cfg.used_enter, cfg.used_exit), None))
            if failures is not None:
                evidence.append(ev("cuda_alloc_failures_total (increase)", failures, 0.0, w))
            if ooms is not None:
                evidence.append(ev("allocator_ooms_total (increase)", ooms, 0.0, w))
            if retries is not None:
                evidence.append(ev("allocator_alloc_retries_total (increase)", retries, 0.0, w))
            if frag is not None:
                evidence.append(ev("allocator_inactive_split_bytes / allocator_reserved_bytes", frag, cfg.fragmentation_enter, None))
            parts = []
            if oom:
                parts.append(f"{(failures or 0) + (ooms or 0):g} allocation failures/OOMs in {w:g}s")
            if fragmented:
                parts.append(f"allocator {frag:.0%} fragmented")
            if retrying_full:
                parts.append(f"device memory {used:.0%} used with {retries:g} allocator retries")
            summary = "; ".join(parts) or "GPU memory tight"
            yield subject, key, self.finding(enter, stay, Severity.CRITICAL if oom else Severity.WARNING, summary, evidence, 0.9 if oom else 0.7)


class GpuFault(Rule[GpuFaultConfig]):
    """A new critical XID (critical_xids) or a new uncorrected ECC error on a GPU within event_window_seconds.

    Application XIDs (13 graphics exception, 31 page fault, 43 channel stopped) are the
    program's fault, not the GPU's, and are ignored here.
    """

    kind = "gpu_fault"
    history = reads("g", "xid_errors_total", "ecc_uncorrected_total")
    remediation = "Eject the backend; drain it and reset the GPU (nvidia-smi -r) or the node."

    def evaluate(self, ctx: Context) -> Iterable[Verdict]:
        cfg = self.config
        w = cfg.event_window_seconds
        critical = {str(x) for x in cfg.critical_xids}
        for g in sorted(ctx.snapshot.gpus):
            subject = ctx.owner_of_gpu(g)
            signals = ctx.snapshot.gpus[g]
            if "xid_errors_total" not in signals and "ecc_uncorrected_total" not in signals:
                yield subject, g, None
                continue
            evidence = []
            xids = []
            for key, parsed in ctx.labelled(signals, "xid_errors_total").items():
                xid = parsed.get("xid", "")
                if xid in critical:
                    inc = ctx.increase("g", g, f"xid_errors_total{{{key}}}", w)
                    if inc:
                        xids.append(xid)
                        evidence.append(ev(f"gpus[{g}].xid_errors_total{{xid={xid}}} (increase)", inc, 0.0, w))
            ecc = ctx.increase("g", g, "ecc_uncorrected_total", w)
            if ecc:
                evidence.append(ev(f"gpus[{g}].ecc_uncorrected_total (increase)", ecc, 0.0, w))
            fault = bool(xids) or bool(ecc)
            summary = f"GPU {g}: " + ", ".join([f"XID {x}" for x in sorted(set(xids), key=int)] + (["uncorrected ECC errors"] if ecc else []))
            yield subject, g, self.finding(fault, fault, Severity.CRITICAL, summary if fault else f"GPU {g}: no fault", evidence, 0.95)


class GpuThrottling(Rule[GpuThrottlingConfig]):
    """Thermal, power or hardware-slowdown clock reasons active while the GPU is busy (>= busy_utilization)."""

    kind = "gpu_throttling"
    remediation = "Check cooling and power caps (nvidia-smi -q -d PERFORMANCE); lower this backend's weight meanwhile."

    def evaluate(self, ctx: Context) -> Iterable[Verdict]:
        cfg = self.config
        for g in sorted(ctx.snapshot.gpus):
            subject = ctx.owner_of_gpu(g)
            signals = ctx.snapshot.gpus[g]
            util = ctx.gpu(g, "gpu_utilization")
            if "throttle_reasons" not in signals or util is None:
                yield subject, g, None
                continue
            harmful = sorted(throttle_names(signals["throttle_reasons"]) & _HARMFUL)
            busy = util >= cfg.busy_utilization
            enter = bool(harmful) and busy
            stay = bool(harmful) and util >= 0.8 * cfg.busy_utilization
            severity = Severity.CRITICAL if set(harmful) & _HW else Severity.WARNING
            evidence = [
                ev(f"gpus[{g}].throttle_reasons", ",".join(harmful) or "none", "thermal/power/hw slowdown", cfg.for_seconds),
                ev(f"gpus[{g}].gpu_utilization", util, cfg.busy_utilization, cfg.for_seconds),
            ]
            clock = ctx.gpu(g, "sm_clock_hz")
            if clock is not None:
                evidence.append(ev(f"gpus[{g}].sm_clock_hz", clock, None, None))
            summary = f"GPU {g} throttled ({', '.join(harmful) or 'none'}) at {util:.0%} utilisation"
            yield subject, g, self.finding(enter, stay, severity, summary, evidence, 0.85)


class GpuIdleWithQueue(Rule[GpuIdleWithQueueConfig]):
    """Requests wait (> min_waiting) while every GPU of the backend is below util_enter.

    The backend's utilisation is the **max** over its GPUs' ``gpu_utilization``
    (:meth:`Context.gpus_for`): one busy GPU means the engine is computing (a
    tensor-parallel group runs in lockstep, a data-parallel one has work), so
    only "all idle" points at the CPU side. No collector gives a backend-scope
    ``gpu_utilization``."""

    kind = "gpu_idle_with_queue"
    remediation = "The engine is starved by the CPU side: scheduler, tokenizer, or an IO stall; profile the engine process."

    def evaluate(self, ctx: Context) -> Iterable[Verdict]:
        cfg = self.config
        for b in ctx.backends:
            waiting = ctx.worst(b, "requests_waiting")
            utils = [u for u in (ctx.gpu(g, "gpu_utilization") for g in ctx.gpus_for(b)) if u is not None]
            if waiting is None or not utils or ctx.up(b) is False:
                yield b, "", None
                continue
            util = max(utils)
            queued = waiting[1] > cfg.min_waiting
            evidence = [ev(waiting[0], waiting[1], cfg.min_waiting, cfg.for_seconds),
                        ev("gpu_utilization (max of its GPUs)", util, bar(util < cfg.util_enter, cfg.util_enter, cfg.util_exit), cfg.for_seconds)]
            summary = f"{waiting[1]:g} requests waiting while its GPUs run at {util:.0%}"
            yield b, "", self.finding(queued and util < cfg.util_enter, queued and util < cfg.util_exit, Severity.WARNING, summary, evidence, 0.8)


class IoBlocking(Rule[IoBlockingConfig]):
    """Engine threads in D state (>= dstate_threads_enter), or read_bytes spiking (>= read_factor x
    baseline and >= the floor) while GPU utilisation drops below util_drop_fraction of its baseline;
    on the host, PSI io full avg10 >= psi_io_full_enter."""

    kind = "io_blocking"
    history = reads("b", "io_read_bytes_total")
    remediation = "Pin model weights in memory (no mmap page-in, no swap); use faster local storage."

    def evaluate(self, ctx: Context) -> Iterable[Verdict]:
        cfg = self.config
        span = cfg.rate_window_seconds
        for b in ctx.backends:
            dstate = ctx.backend(b, "threads_dstate")
            reads = ctx.rate("b", b, "io_read_bytes_total", span)
            base_reads = ctx.baseline(b, "io_read_rate", reads)
            utils = [u for u in (ctx.gpu(g, "gpu_utilization") for g in ctx.gpus_for(b)) if u is not None]
            util = max(utils) if utils else None
            base_util = ctx.baseline(b, "gpu_util", util)
            if dstate is None and reads is None:
                yield b, "", None
                continue
            spike = (
                reads is not None
                and reads >= cfg.read_floor_bytes_per_second
                and (base_reads is None or reads >= cfg.read_factor * base_reads)
                and util is not None
                and base_util is not None
                and util < cfg.util_drop_fraction * base_util
            )
            blocked = dstate is not None and dstate >= cfg.dstate_threads_enter

            def explain() -> tuple[str, list[Evidence]]:
                evidence = []
                if dstate is not None:
                    evidence.append(ev("threads_dstate", dstate, cfg.dstate_threads_enter, cfg.for_seconds))
                if reads is not None:
                    evidence.append(ev("io_read_bytes per second", reads, max(cfg.read_floor_bytes_per_second, cfg.read_factor * (base_reads or 0)), span))
                if util is not None and base_util is not None:
                    evidence.append(ev("gpu_utilization", util, cfg.util_drop_fraction * base_util, None))
                parts = []
                if blocked:
                    parts.append(f"{dstate:g} engine threads blocked in D state")
                if spike:
                    parts.append(f"reading {reads / 1e6:.0f} MB/s while GPU utilisation fell to {util:.0%}")
                return "; ".join(parts) or "engine IO normal", evidence

            stay = (dstate is not None and dstate >= 1) or spike
            yield b, "", self.explained(blocked or spike, stay, Severity.WARNING, explain, 0.75)
        psi = ctx.host("psi_io_full_avg10")
        if psi is None:
            yield HOST, "", None
        else:
            evidence = [ev("psi_io_full_avg10", psi, bar(psi >= cfg.psi_io_full_enter, cfg.psi_io_full_enter, cfg.psi_io_full_exit), 10.0)]
            yield HOST, "", self.finding(psi >= cfg.psi_io_full_enter, psi >= cfg.psi_io_full_exit, Severity.WARNING, f"all tasks stalled on IO {psi:.0%} of the time (PSI io full)", evidence, 0.8)

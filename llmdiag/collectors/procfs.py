"""/proc collector: per-backend process signals and host pressure (SPEC 3.2 "process", "host").

Per backend with a pid (``Sample(Scope.BACKEND, backend.name, ...)``):

====================== ============================================================
``io_read_bytes_total``  /proc/PID/io ``read_bytes`` (bytes the block layer fetched)
``io_rchar_total``       /proc/PID/io ``rchar`` (bytes read(2) returned, page cache included)
``io_write_bytes_total`` /proc/PID/io ``write_bytes``
``threads_dstate``       threads in state ``D`` among /proc/PID/task/*/stat
``major_faults_total``   /proc/PID/stat ``majflt``
``cpu_seconds_total``    /proc/PID/stat ``utime + stime`` / CLK_TCK
``rss_bytes``            /proc/PID/status ``VmRSS`` (live kernel: statm resident pages, the same counters)
``mapped_file_bytes``    /proc/PID/smaps_rollup ``Rss - Anonymous`` (file-backed resident pages)
``swap_bytes``           /proc/PID/smaps_rollup ``Swap``
``open_fds``             entries of /proc/PID/fd (Linux 6.2+: the directory's ``st_size``, the same count)
====================== ============================================================

Host (``Scope.HOST``): ``psi_cpu_some_avg10``, ``psi_io_some_avg10``,
``psi_io_full_avg10``, ``psi_memory_full_avg10`` (PSI ``avg10`` percentages
divided by 100: ratios 0..1), ``conntrack_entries``, ``conntrack_max``,
``sockstat_tcp_inuse``, ``sockstat_tcp_tw``.

Every path is under ``proc_root``. A file that is missing or unreadable
(permissions, PSI disabled) means the signal is absent. A process that
vanishes mid-read is *gone*: its signals are absent this tick and it is not an
error. Malformed content is logged once per file and makes the collector
``degraded`` naming the file. So does finding nothing: a backend without a
local process (no pid), a process whose files this user may not read (another
user's engine without root or ``CAP_SYS_PTRACE``), or no host signal at all:
the status says which, never ``ok`` over an empty result.

Two reads run on a slower cadence (``[proc]``): the D-state thread scan every
``dstate_every_ticks`` ticks (one read per thread) and ``smaps_rollup`` every
``smaps_rollup_every_ticks`` (the kernel walks every mapping to answer). In
between, their signals repeat the last reading of the same pid, and so do
the malformed-file reasons they found; a new pid (an engine restart) is read
at once.

On the live kernel (``proc_root`` a procfs mount) the files read every tick
stay open and are re-read with one ``pread`` each (:mod:`procfd`: a kept
descriptor of an exited process fails, and the file is then opened by path as
before, which finds a reused pid's new process or none); the fd count is one
``fstat``; a process with one thread has its D state from its own stat line
instead of a listing of /proc/PID/task. A recorded tree is read by path, file by
file, as it always was.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from llmdiag.collectors.procfd import KeptFiles, is_procfs, read_path
from llmdiag.collectors.sample_reuse import SampleReuse
from llmdiag.config import Config
from llmdiag.model import Backend, CollectorState, CollectorStatus, Sample, Scope

__all__ = ["ProcCollector", "ProcessGone", "build_proc_collector", "parse_psi", "parse_sockstat", "parse_task_state"]

log = logging.getLogger(__name__)

_PSI_SIGNALS = {
    ("cpu", "some"): "psi_cpu_some_avg10",
    ("io", "some"): "psi_io_some_avg10",
    ("io", "full"): "psi_io_full_avg10",
    ("memory", "full"): "psi_memory_full_avg10",
}
_IO_FIELDS = {b"read_bytes": "io_read_bytes_total", b"rchar": "io_rchar_total", b"write_bytes": "io_write_bytes_total"}


class ProcessGone(Exception):
    """The process exited (or its pid was reaped) while we read it."""


class Malformed(ValueError):
    """A /proc file whose content we cannot parse."""


_read = read_path  # a whole (small) file by path; FileNotFoundError/ProcessLookupError pass through


def parse_task_state(stat: bytes) -> str:
    """The state letter of a /proc/PID[/task/TID]/stat line.

    ``comm`` (field 2) is in parentheses and may itself contain spaces and
    ``)`` (a thread may name itself ``"a) b"``), so the fields are read after
    the *last* ``)``, as the kernel's own tools do.
    """
    end = stat.rfind(b")")
    if end < 0 or len(stat) < end + 3:
        raise Malformed(f"no state after comm in {stat[:80]!r}")
    return chr(stat[end + 2])


def parse_stat_fields(stat: bytes) -> list[bytes]:
    """Fields 3.. of a stat line (state first), split after the last ``)``."""
    end = stat.rfind(b")")
    if end < 0:
        raise Malformed(f"no comm in {stat[:80]!r}")
    return stat[end + 2 :].split()


def parse_psi(text: bytes) -> dict[str, float]:
    """``some avg10=1.54 avg60=...`` lines -> ``{"some": 0.0154, "full": ...}`` (avg10 as a ratio)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        parts = line.split()
        if not parts:
            continue
        kind = parts[0].decode("ascii", "replace")
        for field in parts[1:]:
            key, _, value = field.partition(b"=")
            if key == b"avg10":
                try:
                    out[kind] = float(value) / 100.0
                except ValueError:
                    raise Malformed(f"bad avg10 value {value!r}") from None
        if kind not in out:
            raise Malformed(f"no avg10 in {line[:80]!r}")
    return out


def parse_sockstat(text: bytes) -> dict[str, int]:
    """The ``TCP:`` line of /proc/net/sockstat -> ``{"inuse": 4, "orphan": 0, "tw": 4, "alloc": 17, "mem": 1}``."""
    for line in text.splitlines():
        if line.startswith(b"TCP:"):
            parts = line.split()[1:]
            if len(parts) % 2:
                raise Malformed(f"odd TCP line {line!r}")
            try:
                return {parts[i].decode(): int(parts[i + 1]) for i in range(0, len(parts), 2)}
            except ValueError:
                raise Malformed(f"bad number in {line!r}") from None
    raise Malformed("no TCP: line")


def _kib_fields(text: bytes, wanted: set[bytes]) -> dict[bytes, int]:
    """``Name:   1234 kB`` lines (status, smaps_rollup) -> bytes for the wanted names."""
    out: dict[bytes, int] = {}
    for line in text.splitlines():
        name, sep, rest = line.partition(b":")
        if sep and name in wanted:
            parts = rest.split()
            try:
                out[name] = int(parts[0]) * 1024
            except (IndexError, ValueError):
                raise Malformed(f"bad {name.decode()} line {line!r}") from None
    return out


class ProcCollector:
    """Reads /proc for backend processes and host pressure. ``proc_root`` may point at a recorded tree."""

    name = "proc"

    def __init__(
        self,
        backends: Iterable[Backend] = (),
        *,
        proc_root: str | Path = "/proc",
        dstate_threads: bool = True,
        max_threads_per_process: int = 512,
        clock_ticks: int | None = None,
        dstate_every_ticks: int = 1,
        smaps_rollup_every_ticks: int = 1,
    ) -> None:
        self.backends = list(backends)
        self.proc_root = str(proc_root)
        self.dstate_threads = dstate_threads
        self.max_threads_per_process = max_threads_per_process
        self.clock_ticks = clock_ticks or os.sysconf("SC_CLK_TCK")
        self.dstate_every_ticks = max(1, dstate_every_ticks)
        self.smaps_rollup_every_ticks = max(1, smaps_rollup_every_ticks)
        self._tick = 0
        # (pid, "dstate" | "smaps_rollup") -> (tick read, signals, malformed reasons) of the last read.
        self._slow: dict[tuple[int, str], tuple[int, dict[str, Any], dict[str, str]]] = {}
        self.gone: dict[str, int] = {}  # backend name -> pid that vanished in the last tick
        self._malformed: dict[str, str] = {}  # path -> why, for this tick
        self._nothing: list[str] = []  # what this tick could not find, for the status
        self._warned: set[str] = set()
        self._last_ok_ts: float | None = None
        self._reuse = SampleReuse()  # an idle process's signals repeat: its samples are built once
        # On a real procfs the files read every tick stay open and are re-read with pread
        # (see procfd): keys are (pid, file name) and host paths. None on a recorded tree.
        self._kept: KeptFiles | None = KeptFiles() if is_procfs(self.proc_root) else None
        # pid -> state letter of its only thread, from this tick's /proc/PID/stat (see _dstate).
        self._single_thread: dict[int, str] = {}
        self._page_size = os.sysconf("SC_PAGE_SIZE")

    def set_backends(self, backends: Iterable[Backend]) -> None:
        self.backends = list(backends)

    def close(self) -> None:
        """Close the kept descriptors (a later collect opens them again)."""
        if self._kept is not None:
            self._kept.close_all()

    # -- collection -------------------------------------------------------------
    def collect(self, now: float) -> list[Sample]:
        self._malformed = {}
        self.gone = {}
        self._tick += 1
        pids = {b.pid for b in self.backends if b.pid is not None}
        for key in [k for k in self._slow if k[0] not in pids]:
            del self._slow[key]  # a restarted or removed backend's old pid
        if self._kept is not None:
            self._kept.drop_where(lambda k: not isinstance(k, tuple) or k[0] in pids)
        self._single_thread = {}
        nothing: list[str] = []
        host = self.host_signals()
        if not host:
            nothing.append(f"no host signal under {self.proc_root} (pressure/, net/sockstat, conntrack)")
        samples = [Sample(Scope.HOST, "", name, value) for name, value in host.items()]
        no_pid = [b.name for b in self.backends if b.pid is None]
        if no_pid:
            nothing.append(f"no local process found for {', '.join(no_pid)}: process signals absent "
                           "(engine on another host, or its listening socket not visible: run as root)")
        unreadable = []
        for backend in self.backends:
            if backend.pid is None:
                continue
            try:
                signals = self.process_signals(backend.pid)
            except ProcessGone:
                self.gone[backend.name] = backend.pid
                if self._kept is not None:
                    self._kept.drop_where(lambda k, pid=backend.pid: not isinstance(k, tuple) or k[0] != pid)
                continue
            if "io_read_bytes_total" not in signals and not self._malformed_in(backend.pid):
                unreadable.append(f"{backend.name} (pid {backend.pid})")
            samples.extend(self._reuse.each(((Scope.BACKEND, backend.name),), signals))
        if unreadable:
            nothing.append(f"cannot read /proc/PID/io of {', '.join(unreadable)}: IO signals absent "
                           "(another user's process needs root or CAP_SYS_PTRACE)")
        self._reuse.next_tick()
        self._nothing = nothing
        self._last_ok_ts = now
        return samples

    def _malformed_in(self, pid: int) -> bool:
        """Whether this tick already reported a malformed file of ``pid`` (then that is the reason)."""
        base = os.path.join(self.proc_root, str(pid)) + os.sep
        return any(path.startswith(base) for path in self._malformed)

    def host_signals(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for resource in ("cpu", "io", "memory"):
            psi = self._parsed(f"pressure/{resource}", parse_psi)
            if psi is None:
                continue
            for (res, kind), name in _PSI_SIGNALS.items():
                if res == resource and kind in psi:
                    out[name] = psi[kind]
        for name, rel in (("conntrack_entries", "sys/net/netfilter/nf_conntrack_count"),
                          ("conntrack_max", "sys/net/netfilter/nf_conntrack_max")):
            value = self._parsed(rel, _parse_int)
            if value is not None:
                out[name] = value
        sockstat = self._parsed("net/sockstat", parse_sockstat)
        if sockstat is not None:
            if "inuse" in sockstat:
                out["sockstat_tcp_inuse"] = sockstat["inuse"]
            if "tw" in sockstat:
                out["sockstat_tcp_tw"] = sockstat["tw"]
        return out

    def process_signals(self, pid: int) -> dict[str, Any]:
        """Signals of one process; raises :class:`ProcessGone` when it no longer exists."""
        base = os.path.join(self.proc_root, str(pid))
        out: dict[str, Any] = {}
        # stat first: if the process is not there at all, it is gone, full stop.
        stat = self._proc_file(base, "stat", pid)
        if stat is None:
            raise ProcessGone(pid)
        try:
            fields = parse_stat_fields(stat)
            # After the last ')': [0]=state(3) ... [9]=majflt(12) [11]=utime(14) [12]=stime(15)
            out["major_faults_total"] = int(fields[9])
            out["cpu_seconds_total"] = (int(fields[11]) + int(fields[12])) / self.clock_ticks
            if self._kept is not None and len(fields) > 17 and fields[17] == b"1":
                self._single_thread[pid] = chr(fields[0][0])  # [17]=num_threads(20)
        except (Malformed, IndexError, ValueError) as exc:
            self._note_malformed(f"{base}/stat", str(exc))

        io = self._proc_file(base, "io", pid)  # root-only for other users' processes: absent, not an error
        if io is not None:
            for line in io.splitlines():
                key, _, value = line.partition(b":")
                if key in _IO_FIELDS:
                    try:
                        out[_IO_FIELDS[key]] = int(value)
                    except ValueError:
                        self._note_malformed(f"{base}/io", f"bad {key.decode()} value {value.strip()[:40]!r}")

        if self._kept is not None:
            self._rss_from_statm(pid, base, out)
        else:
            status = self._proc_file(base, "status", pid)
            if status is not None:
                try:
                    rss = _kib_fields(status, {b"VmRSS"}).get(b"VmRSS")
                    if rss is not None:  # kernel threads and zombies have no VmRSS
                        out["rss_bytes"] = rss
                except Malformed as exc:
                    self._note_malformed(f"{base}/status", str(exc))

        out.update(self._every(pid, "smaps_rollup", self.smaps_rollup_every_ticks, lambda: self._rollup(base)))

        counted = self._kept_fd_count(pid, base)
        try:
            out["open_fds"] = counted if counted else len(os.listdir(os.path.join(base, "fd")))
        except (FileNotFoundError, ProcessLookupError):
            if not os.path.exists(base):
                raise ProcessGone(pid) from None
        except OSError:
            pass  # EACCES without CAP_SYS_PTRACE: absent

        if self.dstate_threads:
            out.update(self._every(pid, "dstate", self.dstate_every_ticks, lambda: self._dstate(base, pid)))
        return out

    def _rss_from_statm(self, pid: int, base: str, out: dict[str, Any]) -> None:
        """``rss_bytes`` from /proc/PID/statm on the live kernel: its resident pages are the
        counters VmRSS of /proc/PID/status adds up (anon + file + shmem pages), and statm costs
        the kernel a fifth of status (some 55 formatted lines). A task without an mm (a kernel
        thread, a zombie) has no VmRSS line and an all-zero statm (size 0): absent either way."""
        statm = self._proc_file(base, "statm", pid)
        if statm is None:
            return
        fields = statm.split()
        try:
            size, resident = int(fields[0]), int(fields[1])
        except (IndexError, ValueError):
            self._note_malformed(f"{base}/statm", f"bad statm {statm[:80]!r}")
            return
        if size:
            out["rss_bytes"] = resident * self._page_size

    def _kept_fd_count(self, pid: int, base: str) -> int:
        """Open descriptors of ``pid`` from ``st_size`` of its kept /proc/PID/fd (Linux 6.2+
        counts them there: one fstat instead of listing the directory), or 0 when that does not
        tell (no kept descriptors, an older kernel, no fds at all, any error): then the caller
        lists the directory as before. Opening the directory for reading is checked against the
        same permission as listing it, so a process we may not list is never counted."""
        if self._kept is None:
            return 0
        key = (pid, "fd")
        fd = self._kept.get(key)
        try:
            if fd is None:
                fd = self._kept.open(key, os.path.join(base, "fd"), os.O_RDONLY | os.O_DIRECTORY)
            return os.fstat(fd).st_size
        except OSError:
            self._kept.drop(key)
            return 0

    def _every(self, pid: int, what: str, every: int, read: Any) -> dict[str, Any]:
        """``read()``'s signals, read on the first tick of ``pid`` and then every ``every`` ticks;
        in between, the last reading and the malformed files it found (so the status does not flip)."""
        last = self._slow.get((pid, what))
        if last is not None and self._tick - last[0] < every:
            for path, why in last[2].items():
                self._malformed[path] = why
            return last[1]
        before = dict(self._malformed)
        signals = read()  # ProcessGone passes through: nothing is kept for a gone pid
        found = {p: w for p, w in self._malformed.items() if before.get(p) != w}
        self._slow[(pid, what)] = (self._tick, signals, found)
        return signals

    def _rollup(self, base: str) -> dict[str, Any]:
        # smaps_rollup (Linux 4.14+). Rss - Anonymous = file-backed resident
        # pages (mmap'd weights, libraries; shmem/tmpfs counts as file-backed too).
        out: dict[str, Any] = {}
        rollup = self._proc_file(base, "smaps_rollup")
        if rollup is not None:
            try:
                kib = _kib_fields(rollup, {b"Rss", b"Anonymous", b"Swap"})
                if b"Rss" in kib and b"Anonymous" in kib:
                    out["mapped_file_bytes"] = kib[b"Rss"] - kib[b"Anonymous"]
                if b"Swap" in kib:
                    out["swap_bytes"] = kib[b"Swap"]
            except Malformed as exc:
                self._note_malformed(f"{base}/smaps_rollup", str(exc))
        return out

    def _dstate(self, base: str, pid: int) -> dict[str, Any]:
        # A process with one thread (num_threads in this tick's /proc/PID/stat, on a real procfs):
        # that thread is the one /proc/PID/stat describes, so its state is already known and
        # /proc/PID/task need not be listed. A recorded tree is always scanned.
        state = self._single_thread.get(pid)
        if state is not None:
            return {"threads_dstate": int(state == "D")}
        dstate = self._dstate_count(base)
        return {} if dstate is None else {"threads_dstate": dstate}

    def _dstate_count(self, base: str) -> int | None:
        task_dir = os.path.join(base, "task")
        try:
            task_fd = os.open(task_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except (FileNotFoundError, ProcessLookupError):
            raise ProcessGone(base) from None
        except OSError:
            return None
        try:
            tids = os.listdir(task_fd)
            if len(tids) > self.max_threads_per_process:
                # Keep the lowest tids (the main thread and the oldest workers) so the sample is stable.
                tids = sorted(tids, key=lambda t: int(t) if t.isdigit() else 0)[: self.max_threads_per_process]
            count = 0
            for tid in tids:
                # Opening relative to the task directory skips re-walking /proc/PID/task for
                # every thread: with hundreds of threads per engine this is most of the tick.
                try:
                    fd = os.open(f"{tid}/stat", os.O_RDONLY | os.O_CLOEXEC, dir_fd=task_fd)
                except OSError:
                    continue  # that thread exited between listdir and open
                try:
                    stat = os.read(fd, 4096)  # one stat line is < 1 KiB
                except OSError:
                    continue
                finally:
                    os.close(fd)
                try:
                    if parse_task_state(stat) == "D":
                        count += 1
                except Malformed as exc:
                    self._note_malformed(os.path.join(task_dir, tid, "stat"), str(exc))
            return count
        finally:
            os.close(task_fd)

    # -- file helpers -------------------------------------------------------------
    def _proc_file(self, base: str, name: str, pid: int | None = None) -> bytes | None:
        """A per-process file, or None when it is absent or unreadable. ESRCH mid-read means gone.

        With ``pid`` on a real procfs the descriptor is kept (see procfd); a kept descriptor
        that fails (its process exited, the pid may be someone else's now) is dropped and the
        file is opened by path again, so every failure is judged as without one."""
        path = os.path.join(base, name)
        try:
            if self._kept is not None and pid is not None:
                return self._kept.read((pid, name), path)
            return _read(path)
        except OSError as exc:
            return self._unreadable(base, exc)

    @staticmethod
    def _unreadable(base: str, exc: OSError) -> None:
        """What a failed read of a file under ``base`` means: gone (raises), else absent (None)."""
        if isinstance(exc, FileNotFoundError):
            if not os.path.exists(base):
                raise ProcessGone(base) from None
            return None  # an older kernel without this file
        if isinstance(exc, ProcessLookupError) or exc.errno == errno.ESRCH:
            raise ProcessGone(base) from None
        return None  # EACCES/EPERM: not ours to read

    def _parsed(self, rel: str, parse: Any) -> Any:
        path = os.path.join(self.proc_root, rel)
        try:
            text = self._host_file(path)
        except OSError:
            # Missing (no conntrack module, PSI compiled out) or EOPNOTSUPP
            # (kernel booted with psi=0): the signal is absent.
            return None
        try:
            return parse(text)
        except Malformed as exc:
            self._note_malformed(path, str(exc))
            return None

    def _host_file(self, path: str) -> bytes:
        """A host file by path, through a kept descriptor on a real procfs (re-opened once
        when the kept one fails); ``OSError`` as a read by path would raise it."""
        return _read(path) if self._kept is None else self._kept.read(path, path)

    def _note_malformed(self, path: str, why: str) -> None:
        self._malformed[path] = why
        if path not in self._warned:
            self._warned.add(path)
            log.warning("malformed %s: %s", path, why)

    def status(self) -> CollectorStatus:
        problems = [f"malformed {p}: {w}" for p, w in sorted(self._malformed.items())] + self._nothing
        if problems:
            return CollectorStatus(CollectorState.DEGRADED, "; ".join(problems), self._last_ok_ts)
        return CollectorStatus(CollectorState.OK, None, self._last_ok_ts)


def _parse_int(text: bytes) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise Malformed(f"not an integer: {text[:40]!r}") from None


def build_proc_collector(config: Config, backends: list[Backend]) -> ProcCollector:
    """COLLECTOR_FACTORIES["proc"]: backends' pids from Backend.pid; without any, host signals only."""
    c = config.proc
    return ProcCollector(
        backends,
        proc_root=c.proc_root,
        dstate_threads=c.dstate_threads,
        max_threads_per_process=c.max_threads_per_process,
        dstate_every_ticks=c.dstate_every_ticks,
        smaps_rollup_every_ticks=c.smaps_rollup_every_ticks,
    )

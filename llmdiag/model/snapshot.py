"""Samples, collector status and the per-tick Snapshot (SPEC section 3.2).

Collectors return :class:`Sample` objects; the agent folds one tick's samples
into a :class:`Snapshot`. The snapshot serialises to JSON with
``schema: "llmdiag.snapshot/v1"``::

    {"schema": "llmdiag.snapshot/v1", "ts": 1733140000.0, "hostname": "gpu-node-7",
     "host": {"psi_io_full_avg10": 0.0, ...,
              "destinations": {"10.0.0.7:8000": {"timewait_sockets": 812, ...}}},
     "backends": {"vllm-0": {"requests_waiting": 3, "ttft_seconds": {"p50": ...},
                             "engines": {"0": {...}, "1": {...}}}},
     "gpus": {"0": {"gpu_utilization": 0.93, ...}},
     "collectors": {"engine": {"status": "ok", "reason": null, "last_ok_ts": 1733140000.0}}}

``host.destinations`` holds per-destination (``ip:port``) host signals and
``backends[name].engines`` the per data-parallel-engine signals of a backend
(keyed by the engine's ``engine`` label); both are reserved keys, never
signal names.
"""

from __future__ import annotations

import enum
import gzip
import io
import json
import logging
import math
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from llmdiag.model.signals import SignalValue, Signals, decode_value, encode_value

__all__ = [
    "SNAPSHOT_SCHEMA",
    "CollectorState",
    "CollectorStatus",
    "Sample",
    "Scope",
    "Snapshot",
    "SnapshotError",
    "read_snapshots",
    "write_snapshots",
]

SNAPSHOT_SCHEMA = "llmdiag.snapshot/v1"
_DESTINATIONS = "destinations"
_ENGINES = "engines"


class SnapshotError(ValueError):
    """A snapshot document that does not follow ``llmdiag.snapshot/v1``."""


class Scope(str, enum.Enum):
    """What a sample describes."""

    HOST = "host"
    DESTINATION = "destination"  # subject: "ip:port"
    BACKEND = "backend"  # subject: backend name
    ENGINE = "engine"  # subject: backend name, engine: DP engine label
    GPU = "gpu"  # subject: NVML index as a string


class Sample:
    """One signal value from one collector.

    ``subject`` names the backend, GPU index or destination (empty for the
    host). ``engine`` is the data-parallel engine label for
    :attr:`Scope.ENGINE` samples.

    Immutable, compared and hashed by value, like the frozen dataclass it replaced: a plain
    ``__slots__`` class with a hand-written ``__init__`` because collectors build ~1,100 a tick
    and the dataclass's frozen ``__init__`` (``object.__setattr__`` per field) cost twice as much.
    """

    __slots__ = ("scope", "subject", "name", "value", "engine")
    __match_args__ = ("scope", "subject", "name", "value", "engine")

    scope: Scope
    subject: str
    name: str
    value: SignalValue
    engine: str | None

    def __init__(self, scope: Scope, subject: str, name: str, value: SignalValue, engine: str | None = None) -> None:
        if name == _DESTINATIONS or name == _ENGINES:
            raise ValueError(f"{name!r} is a reserved key, not a signal name")
        if (scope is Scope.ENGINE) != (engine is not None):
            raise ValueError("engine label is required for, and only for, Scope.ENGINE samples")
        _set = object.__setattr__
        _set(self, "scope", scope)
        _set(self, "subject", subject)
        _set(self, "name", name)
        _set(self, "value", value)
        _set(self, "engine", engine)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"cannot assign to field {name!r}: Sample is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"cannot delete field {name!r}: Sample is immutable")

    def _fields(self) -> tuple[Any, ...]:
        return (self.scope, self.subject, self.name, self.value, self.engine)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not Sample:
            return NotImplemented
        return self._fields() == other._fields()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(self._fields())

    def __repr__(self) -> str:
        return (f"Sample(scope={self.scope!r}, subject={self.subject!r}, name={self.name!r}, "
                f"value={self.value!r}, engine={self.engine!r})")

    def __reduce__(self) -> tuple[Any, ...]:
        return (Sample, self._fields())


class CollectorState(str, enum.Enum):
    OK = "ok"
    DEGRADED = "degraded"
    UNAVAILABLE = "unavailable"


@dataclass(frozen=True, slots=True)
class CollectorStatus:
    """How a collector is doing: ``ok``, ``degraded`` (some signals missing,
    with the reason) or ``unavailable`` (nothing from it, with the reason and a
    hint)."""

    status: CollectorState
    reason: str | None = None
    last_ok_ts: float | None = None
    errors_total: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status.value,
            "reason": self.reason,
            "last_ok_ts": self.last_ok_ts,
            "errors_total": self.errors_total,
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> CollectorStatus:
        try:
            state = CollectorState(obj["status"])
        except (KeyError, ValueError) as exc:
            raise SnapshotError(f"bad collector status {obj!r}") from exc
        return cls(state, obj.get("reason"), obj.get("last_ok_ts"), int(obj.get("errors_total", 0)))


@dataclass(slots=True)
class Snapshot:
    """Everything collected on one host in one tick."""

    ts: float
    hostname: str = ""
    host: Signals = field(default_factory=dict)
    destinations: dict[str, Signals] = field(default_factory=dict)
    backends: dict[str, Signals] = field(default_factory=dict)
    engines: dict[str, dict[str, Signals]] = field(default_factory=dict)
    gpus: dict[str, Signals] = field(default_factory=dict)
    collectors: dict[str, CollectorStatus] = field(default_factory=dict)

    # -- building ---------------------------------------------------------
    def add(self, sample: Sample) -> None:
        """Place one sample; a later sample for the same signal replaces an earlier one."""
        self.signals_for(sample.scope, sample.subject, sample.engine)[sample.name] = sample.value

    def extend(self, samples: Iterable[Sample]) -> None:
        """:meth:`add` each sample, in order.

        Collectors emit a subject's samples together, so the signal map is looked up once per
        run of samples with the same scope, subject and engine, not once per sample (the agent
        folds ~1,100 samples a tick). The same map :meth:`signals_for` gives, so the same result."""
        signals: Signals | None = None
        scope: Scope | None = None
        subject: str | None = None
        engine: str | None = None
        for sample in samples:
            if sample.scope is not scope or sample.subject != subject or sample.engine != engine or signals is None:
                scope, subject, engine = sample.scope, sample.subject, sample.engine
                signals = self.signals_for(scope, subject, engine)
            signals[sample.name] = sample.value

    def signals_for(self, scope: Scope, subject: str = "", engine: str | None = None) -> Signals:
        """The (mutable) signal map for a scope and subject, created if missing."""
        if scope is Scope.HOST:
            return self.host
        if scope is Scope.DESTINATION:
            return self.destinations.setdefault(subject, {})
        if scope is Scope.BACKEND:
            return self.backends.setdefault(subject, {})
        if scope is Scope.ENGINE:
            self.backends.setdefault(subject, {})
            return self.engines.setdefault(subject, {}).setdefault(str(engine), {})
        if scope is Scope.GPU:
            return self.gpus.setdefault(str(subject), {})
        raise ValueError(f"unknown scope {scope!r}")

    def samples(self) -> Iterator[Sample]:
        """Every value as a :class:`Sample` (the inverse of :meth:`extend`)."""
        for name, value in self.host.items():
            yield Sample(Scope.HOST, "", name, value)
        for dest, signals in self.destinations.items():
            for name, value in signals.items():
                yield Sample(Scope.DESTINATION, dest, name, value)
        for backend, signals in self.backends.items():
            for name, value in signals.items():
                yield Sample(Scope.BACKEND, backend, name, value)
        for backend, per_engine in self.engines.items():
            for engine, signals in per_engine.items():
                for name, value in signals.items():
                    yield Sample(Scope.ENGINE, backend, name, value, engine=engine)
        for index, signals in self.gpus.items():
            for name, value in signals.items():
                yield Sample(Scope.GPU, index, name, value)

    # -- JSON -------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        host: dict[str, Any] = _encode_signals(self.host)
        if self.destinations:
            host[_DESTINATIONS] = {d: _encode_signals(s) for d, s in sorted(self.destinations.items())}
        backends: dict[str, Any] = {}
        for name in sorted(set(self.backends) | set(self.engines)):
            entry = _encode_signals(self.backends.get(name, {}))
            if self.engines.get(name):
                entry[_ENGINES] = {e: _encode_signals(s) for e, s in sorted(self.engines[name].items())}
            backends[name] = entry
        return {
            "schema": SNAPSHOT_SCHEMA,
            "ts": self.ts,
            "hostname": self.hostname,
            "host": host,
            "backends": backends,
            "gpus": {i: _encode_signals(s) for i, s in sorted(self.gpus.items(), key=lambda kv: _index_order(kv[0]))},
            "collectors": {n: st.to_json() for n, st in sorted(self.collectors.items())},
        }

    def dumps(self, **kwargs: Any) -> str:
        return json.dumps(self.to_json(), allow_nan=False, **kwargs)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Snapshot:
        if not isinstance(obj, Mapping):
            raise SnapshotError("a snapshot must be a JSON object")
        if obj.get("schema") != SNAPSHOT_SCHEMA:
            raise SnapshotError(f"unknown snapshot schema {obj.get('schema')!r} (want {SNAPSHOT_SCHEMA})")
        ts = obj.get("ts")
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
            raise SnapshotError(f"snapshot has no finite numeric 'ts' (got {ts!r})")
        snap = cls(ts=float(ts), hostname=str(obj.get("hostname", "")))
        host = dict(_table(obj.get("host"), "host"))
        for dest, signals in _table(host.pop(_DESTINATIONS, None), "host.destinations").items():
            snap.destinations[dest] = _decode_signals(signals, f"host.destinations[{dest}]")
        snap.host = _decode_signals(host, "host")
        for name, entry in _table(obj.get("backends"), "backends").items():
            entry = dict(_table(entry, f"backends[{name}]"))
            engines = _table(entry.pop(_ENGINES, None), f"backends[{name}].engines")
            snap.backends[name] = _decode_signals(entry, f"backends[{name}]")
            if engines:
                snap.engines[name] = {
                    e: _decode_signals(s, f"backends[{name}].engines[{e}]") for e, s in engines.items()
                }
        for index, signals in _table(obj.get("gpus"), "gpus").items():
            snap.gpus[str(index)] = _decode_signals(signals, f"gpus[{index}]")
        for name, status in _table(obj.get("collectors"), "collectors").items():
            snap.collectors[name] = CollectorStatus.from_json(_table(status, f"collectors[{name}]"))
        return snap

    @classmethod
    def loads(cls, text: str) -> Snapshot:
        try:
            return cls.from_json(json.loads(text))
        except json.JSONDecodeError as exc:
            raise SnapshotError(f"not JSON: {exc}") from exc


def _table(obj: Any, where: str) -> Mapping[str, Any]:
    """A JSON object (``null``/absent = empty); anything else is a :class:`SnapshotError` naming where."""
    if obj is None:
        return {}
    if not isinstance(obj, Mapping):
        raise SnapshotError(f"{where}: expected an object, got {type(obj).__name__}")
    return obj


def _index_order(key: str) -> tuple[int, str]:
    return (int(key), key) if key.isdigit() else (1 << 30, key)


def _encode_signals(signals: Mapping[str, SignalValue]) -> dict[str, Any]:
    return {name: encode_value(value) for name, value in sorted(signals.items())}


def _decode_signals(obj: Any, where: str) -> Signals:
    if not isinstance(obj, Mapping):
        raise SnapshotError(f"{where}: expected an object of signals")
    try:
        return {name: decode_value(value, f"{where}.{name}") for name, value in obj.items()}
    except ValueError as exc:
        raise SnapshotError(str(exc)) from exc


def _open_text(path: Path, mode: str) -> IO[str]:
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, mode + "b"), encoding="utf-8")  # type: ignore[arg-type]
    return open(path, mode, encoding="utf-8")


def write_snapshots(path: str | Path, snapshots: Iterable[Snapshot], append: bool = False) -> int:
    """Write snapshots as JSON lines (gzip when the name ends in ``.gz``); returns the count."""
    count = 0
    with _open_text(Path(path), "a" if append else "w") as fh:
        for snap in snapshots:
            fh.write(snap.dumps(separators=(",", ":")))
            fh.write("\n")
            count += 1
    return count


_READ_CHUNK = 1 << 16
_log = logging.getLogger(__name__)


class _RecordingBytes:
    """The bytes of a recording, gunzipped when the name ends in ``.gz``.

    Gzip is decoded member by member (``write_snapshots(append=True)`` adds one per
    call), and a stream that stops before its end marker (the writer was killed, the
    disk filled up) is not an error here: ``cut_short`` says so after iteration, and
    the reader keeps what came before."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.cut_short = False

    def __iter__(self) -> Iterator[bytes]:
        with open(self.path, "rb") as fh:
            if self.path.suffix != ".gz":
                while chunk := fh.read(_READ_CHUNK):
                    yield chunk
                return
            yield from self._gunzip(fh)

    def _gunzip(self, fh: IO[bytes]) -> Iterator[bytes]:
        member = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
        fed = False
        while data := fh.read(_READ_CHUNK):
            while data:
                fed = True
                try:
                    out = member.decompress(data)
                except zlib.error as exc:
                    raise SnapshotError(f"{self.path}: broken gzip file (corrupt data: {exc})") from None
                if out:
                    yield out
                if not member.eof:
                    break
                data = member.unused_data  # the next member, if any
                member = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
                fed = False
        self.cut_short = fed and not member.eof


def _parse_line(raw: bytes, path: str | Path, lineno: int) -> Snapshot:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SnapshotError(f"{path}:{lineno}: not a text recording ({exc.reason} at byte {exc.start})") from None
    try:
        return Snapshot.loads(line)
    except SnapshotError as exc:
        raise SnapshotError(f"{path}:{lineno}: {exc}") from None


def read_snapshots(path: str | Path, on_cut_tail: Callable[[str], None] | None = None) -> Iterator[Snapshot]:
    """Read a JSONL (optionally gzip) recording.

    A bad line raises :class:`SnapshotError` naming it. A recording whose end was
    cut off (the recorder was killed or the disk filled up: the last line has no
    newline and does not parse, or the gzip stream stops early) yields every complete
    snapshot and reports the cut with ``on_cut_tail(message)`` (default: a logged
    warning). A recording without a single snapshot is a :class:`SnapshotError`
    ("no snapshots in FILE"): no data must never read as a healthy run."""
    source = _RecordingBytes(Path(path))
    count = 0
    lineno = 0
    pending = b""
    for chunk in source:
        lines = (pending + chunk).split(b"\n")
        pending = lines.pop()  # after the last newline: possibly a partial line
        for raw in lines:
            lineno += 1
            if raw.strip():
                yield _parse_line(raw, path, lineno)
                count += 1
    problems = []
    if pending.strip():
        lineno += 1
        try:
            snapshot = _parse_line(pending, path, lineno)
        except SnapshotError:
            problems.append(f"line {lineno} is cut off ({len(pending)} bytes, no newline)")
        else:
            yield snapshot
            count += 1
    if source.cut_short:
        problems.insert(0, "broken gzip file: the stream ends early")
    if count == 0:
        raise SnapshotError(f"no snapshots in {path}" + (f" ({'; '.join(problems)})" if problems else ""))
    if problems:
        message = (f"{path}: {'; '.join(problems)}; was the recorder killed, or the disk full? "
                   f"Replayed the {count} complete snapshot(s) before the cut")
        (on_cut_tail or _log.warning)(message)

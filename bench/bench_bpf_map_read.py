"""What one tick's BPF map reads cost the tcp collector: bcc's per-key reads against batch reads.

    .venv/bin/python bench/bench_bpf_map_read.py --endpoints 16 --slots 20 --rounds 50    # as root, ~20 s

Loads ``tcp_health`` as the agent does (through :class:`TcpCollector`), fills its ``stats`` map
with ``--endpoints`` client endpoints and ``connect_hist`` with ``--slots`` latency slots per
endpoint (what a gateway host's connections leave there), then times, alternating, in one
process (process CPU time, ``time.process_time``; median of ``--rounds``):

* **before**: what :meth:`Program.read_hash` did until this change: ``bpf.get_table()`` (a new
  table with ctypes types decoded from JSON), ``items()`` (two ``bpf()`` syscalls per entry) and
  a recursive ctypes -> Python walk per entry;
* **after**: :meth:`Program.read_hash` (cached table, ``BPF_MAP_LOOKUP_BATCH`` into reused
  buffers, a converter built once per type);

for ``stats`` + ``connect_hist`` + the two arrays (``globals``, ``llmdiag_errors``), and
the whole ``TcpCollector.collect()``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from typing import Any


def old_plain(value: Any) -> Any:
    """The loader's ctypes -> Python walk before this change (kept here to measure against)."""
    if isinstance(value, ctypes.Structure | ctypes.Union):
        return {name: old_plain(getattr(value, name)) for name, *_ in value._fields_}
    if isinstance(value, ctypes.Array):
        if value._type_ in (ctypes.c_ubyte, ctypes.c_byte, ctypes.c_char):
            return bytes(value)
        return [old_plain(v) for v in value]
    if hasattr(value, "value"):
        return value.value
    return value


def old_read_hash(bpf: Any, name: str) -> list[tuple[Any, Any]]:
    table = bpf.get_table(name.encode())
    return [(old_plain(k), old_plain(v)) for k, v in list(table.items())]


def old_read_array(bpf: Any, name: str) -> list[int]:
    table = bpf.get_table(name.encode())
    return [int(getattr(table[table.Key(i)], "value", 0)) for i in range(len(table))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--endpoints", type=int, default=16)
    parser.add_argument("--slots", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args()

    from llmdiag.collectors.tcp import TcpCollector  # noqa: PLC0415

    collector = TcpCollector()
    if collector.program is None:
        print(f"tcp collector unavailable: {collector.unavailable}", file=sys.stderr)
        return 1
    program = collector.program
    try:
        stats, hist = program.table("stats"), program.table("connect_hist")
        for i in range(args.endpoints):
            key = stats.Key()
            key.side, key.family, key.port = 2, 2, 20000 + i
            key.addr[:4] = [10, 0, i // 256, i % 256]
            stats[key] = stats.Leaf(connects=5, connect_ns=5000, send_bytes=1 << 20, sends=100)
            for slot in range(args.slots):
                hkey = hist.Key()
                ctypes.memmove(ctypes.byref(hkey.ep), ctypes.byref(key), ctypes.sizeof(key))  # same C struct
                hkey.slot = 40 + slot
                hist[hkey] = hist.Leaf(3)

        def before() -> None:
            old_read_hash(program.bpf, "stats")
            old_read_hash(program.bpf, "connect_hist")
            old_read_array(program.bpf, "globals")
            old_read_array(program.bpf, "llmdiag_errors")

        def after() -> None:
            program.read_hash("stats")
            program.read_hash("connect_hist")
            program.read_array("globals")
            program.read_array("llmdiag_errors")

        assert sorted(map(repr, old_read_hash(program.bpf, "connect_hist"))) == \
            sorted(map(repr, program.read_hash("connect_hist")))  # same data both ways
        timings: dict[str, list[float]] = {"before": [], "after": [], "collect": []}
        for _ in range(args.rounds):
            for label, fn in (("before", before), ("after", after),
                              ("collect", lambda: collector.collect(time.time()))):
                t0 = time.process_time()
                fn()
                timings[label].append(time.process_time() - t0)
    finally:
        collector.close()
    result = {
        "entries": {"stats": args.endpoints, "connect_hist": args.endpoints * args.slots},
        "map_reads_ms_cpu_median": {k: round(1000 * statistics.median(v), 3) for k, v in timings.items()
                                    if k != "collect"},
        "tcp_collect_ms_cpu_median_after": round(1000 * statistics.median(timings["collect"]), 3),
        "rounds": args.rounds,
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

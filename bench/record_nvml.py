#!/usr/bin/env python3
"""Record an NVML replay file (``llmdiag.nvml-replay/v1``) from the real GPUs of this machine.

Run on any host with an NVIDIA driver (no root needed; nvidia-ml-py installed)::

    python bench/record_nvml.py --ticks 30 --interval 1 -o tests/fixtures/nvml/recorded_<gpu>.json

It makes exactly the per-device calls the GPU collector makes
(``llmdiag.collectors.nvml.QUERIES``), once per tick on every device, records
each answer or NVML error, and listens for XID events between ticks. Replay the
result with ``llmdiag collect --nvml-replay FILE`` or ``[gpu] replay_file``.
Put a line saying what the GPUs were doing in ``--provenance``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmdiag.collectors.nvml import NvmlUnavailable, load_pynvml  # noqa: E402
from llmdiag.collectors.nvml_replay import record  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", required=True, help="replay file to write (JSON)")
    parser.add_argument("--ticks", type=int, default=10, help="number of ticks to record (default 10)")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between ticks (default 1)")
    parser.add_argument("--provenance", default="", help="what ran on the GPUs while recording")
    args = parser.parse_args(argv)
    if args.ticks < 1 or args.interval < 0:
        parser.error("--ticks must be >= 1 and --interval >= 0")
    try:
        pynvml = load_pynvml()
    except NvmlUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    provenance = f"recorded by bench/record_nvml.py on {platform.node()} ({platform.platform()})"
    if args.provenance:
        provenance += f": {args.provenance}"

    def progress(done: int, total: int) -> None:
        print(f"\rtick {done}/{total}", end="", file=sys.stderr, flush=True)

    try:
        doc = record(pynvml, args.ticks, args.interval, provenance, progress)
    except pynvml.NVMLError as exc:
        print(f"\nerror: NVML failed: {exc} (check nvidia-smi)", file=sys.stderr)
        return 2
    Path(args.output).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(f"\nwrote {args.output}: {len(doc['devices'])} device(s), {len(doc['ticks'])} tick(s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

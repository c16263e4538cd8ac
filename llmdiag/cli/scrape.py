"""``llmdiag scrape URL [--json] [--interval S]``: one engine's normalised signals.

Scrapes ``URL/metrics`` twice, ``--interval`` seconds apart (default 1 s),
because window quantiles and EWMAs come from the histogram delta between two
scrapes; with ``--interval 0`` it scrapes once and the distributions are NA.
``--json`` prints ``{"url", "engine", "up", "error", "problems", "models",
"signals": {...}, "engines": {"<engine label>": {...}}}`` with values
encoded as SPEC 3.2; otherwise a table with one column per DP engine and
one for the backend aggregate. Exit code 0 when the engine answered with
known metrics, 1 when it did not, 64 (EX_USAGE) for a bad URL or option.
A URL without a scheme (``127.0.0.1:8000``) means ``http://``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from llmdiag.cli.main import EX_USAGE
from llmdiag.collectors.engine import BackendScrape, EngineCollector
from llmdiag.config import Config
from llmdiag.model import Backend, BackendURLError, Distribution, encode_value


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "scrape",
        help="scrape one engine's /metrics and show llmdiag's normalised signals",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("url", metavar="URL", help="engine base URL, e.g. http://127.0.0.1:8000 (no scheme means http://)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--interval", type=float, default=1.0, metavar="S",
        help="seconds between the two scrapes that give window quantiles (0 = one scrape, quantiles NA)",
    )
    parser.add_argument("--engine", choices=("vllm", "sglang", "trtllm", "triton", "tgi"),
                        help="engine kind, when the scrape alone is ambiguous")
    parser.set_defaults(handler=run)


def scrape_once(url: str, config: Config, interval: float, engine: str | None = None,
                sleep=time.sleep) -> BackendScrape:
    """Scrape ``url`` (twice when ``interval > 0``) and return the last :class:`BackendScrape`."""
    backend = Backend.from_url(url, engine=engine)
    collector = EngineCollector([backend], config.engine)
    try:
        collector.collect(time.time())
        if interval > 0 and collector.results[backend.name].up:
            sleep(interval)
            collector.collect(time.time())
        return collector.results[backend.name]
    finally:
        collector.close()


def to_json(url: str, scrape: BackendScrape) -> dict[str, Any]:
    return {
        "url": url,
        "engine": scrape.engine,
        "up": scrape.up,
        "error": scrape.error,
        "problems": list(scrape.problems),
        "models": list(scrape.models),
        "signals": {k: encode_value(v) for k, v in sorted(scrape.signals.items())},
        "engines": {
            label: {k: encode_value(v) for k, v in sorted(signals.items())}
            for label, signals in scrape.engines.items()
        },
    }


def run(args: argparse.Namespace, config: Config) -> int:
    if args.interval < 0:
        print("llmdiag scrape: --interval must be >= 0", file=sys.stderr)
        return EX_USAGE
    url = args.url.rstrip("/")
    if "://" not in url:
        url = f"http://{url}"  # `scrape host:port`, as curl takes it
    if url.endswith("/metrics"):
        url = url[: -len("/metrics")]
    try:
        scrape = scrape_once(url, config, args.interval, args.engine)
    except BackendURLError as exc:
        print(f"llmdiag scrape: {exc}", file=sys.stderr)
        return EX_USAGE
    if args.json:
        print(json.dumps(to_json(url, scrape), allow_nan=False))
    else:
        _print_table(url, scrape)
    return 0 if scrape.up and scrape.engine else 1


def _cell(value: Any) -> str:
    if value is None:
        return "N/A"
    if isinstance(value, Distribution):
        parts = [("p50", value.p50), ("p99", value.p99), ("ewma", value.ewma)]
        text = " ".join(f"{k} {_number(v)}" for k, v in parts)
        return f"{text} n={_number(value.count)}"
    if isinstance(value, dict):
        return ", ".join(f"{k.split('=', 1)[-1]}={_number(v)}" for k, v in sorted(value.items())) or "-"
    return _number(value)


def _number(value: Any) -> str:
    if value is None:
        return "N/A"
    if isinstance(value, float):
        if value != value:  # NaN / NA
            return "N/A"
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.4g}"
    return str(value)


def _print_table(url: str, scrape: BackendScrape) -> None:
    from rich.console import Console  # noqa: PLC0415 - only the table needs rich
    from rich.table import Table  # noqa: PLC0415
    from rich.text import Text  # noqa: PLC0415

    console = Console()
    title = f"{url}  engine={scrape.engine or '?'}  up={'yes' if scrape.up else 'no'}"
    if scrape.models:
        title += f"  models={', '.join(scrape.models)}"
    table = Table(title=Text(title))
    table.add_column("signal", style="bold")
    labels = list(scrape.engines)
    for label in labels:
        table.add_column(f"engine {label}", overflow="fold")
    table.add_column("backend", overflow="fold", style="cyan")
    names = sorted(set(scrape.signals) | {n for s in scrape.engines.values() for n in s})
    for name in names:
        row = [name] + [_cell(scrape.engines[label].get(name)) if name in scrape.engines[label] else "" for label in labels]
        row.append(_cell(scrape.signals.get(name)) if name in scrape.signals else "")
        table.add_row(*(Text(cell) for cell in row))
    console.print(table)
    # Text, not markup: errors carry brackets ("[Errno 111] ...") that rich would eat.
    if scrape.error:
        console.print(Text(scrape.error, style="red"))
    for problem in scrape.problems:
        console.print(Text.assemble(("warning: ", "yellow"), problem))

"""``llmdiag config [--default]``: print the configuration as TOML.

    llmdiag config --default > llmdiag.toml     every key with its default and what it does
    llmdiag --config llmdiag.toml config        the effective config (file plus --backend)

The output is a complete config file: ``llmdiag --config FILE`` reads it back
to the same settings. Keys whose default is "unset" are written commented out.
"""

from __future__ import annotations

import argparse
from typing import Any

from llmdiag.config import Config, to_toml


def handle(args: argparse.Namespace, config: Config) -> int:
    shown = Config() if args.default else config
    what = "defaults" if args.default else "effective configuration"
    print(f"# llmdiag {what} (TOML; read back with `llmdiag --config FILE`)")
    print(to_toml(shown), end="")
    return 0


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "config",
        help="print the configuration as TOML (--default: every key with its default)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--default", action="store_true",
                        help="print the built-in defaults instead of the effective config")
    parser.set_defaults(handler=handle)

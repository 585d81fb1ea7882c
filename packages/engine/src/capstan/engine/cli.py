"""The `capstan` command line. Subcommands: `info` (so far)."""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["main"]


def _cmd_info(args: argparse.Namespace) -> int:
    from .info import collect_info, format_info

    info = collect_info()
    # --json is one line, written at once, so the outputs of several ranks stay parseable.
    text = json.dumps(info, default=str) if args.json else format_info(info)
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="capstan", description="Train models too big for the hardware at hand.")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="versions, native library, MPI, CUDA and the detected launch")
    info.add_argument("--json", action="store_true", help="print as JSON")
    info.set_defaults(func=_cmd_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

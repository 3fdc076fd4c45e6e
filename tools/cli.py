"""The `specrun` command line: one sub-command per module in tools/.

Each command module defines `register(subparsers)`, which adds its parser and sets
`func=run` on it; `run(args) -> int` returns the exit status.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

COMMAND_MODULES = (
    "generate",
    "check",
    "init-draft",
    "train-draft",
    "eval",
    "eval-plot",
    "convert",
    "bench",
    "export-onnx",
    "compile",
    "serve",
    "tune",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specrun", description="EAGLE speculative decoding for Llama, through the compiler."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(f"specrun.tools.{name.replace('-', '_')}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        return args.func(args)
    except ValueError as e:
        print(f"specrun {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""``hf-ext``: the command line. Each command module follows accelerate's pattern: ``<name>_command_parser(subparsers)``
adds its parser and sets ``func``; ``<name>_command(args)`` parses and calls the library, returning the exit code."""

from __future__ import annotations

import argparse
import sys

from .convert import convert_command_parser
from .ds import ds_command_parser
from .export import export_command_parser
from .fsdp import fsdp_command_parser
from .launch import launch_command_parser

COMMANDS = (ds_command_parser, fsdp_command_parser, export_command_parser, convert_command_parser,
            launch_command_parser)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        "hf-ext", description="hf-ext: DeepSpeed and FSDP fine-tuning helpers for the HF Trainer."
    )
    subparsers = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND")
    for add_parser in COMMANDS:
        add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if not hasattr(args, "func"):
        parser.print_help(sys.stderr)
        return 2
    if rest and not getattr(args, "accepts_extra", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.extra = rest
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

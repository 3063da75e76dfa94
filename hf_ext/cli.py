"""``hf-ext``: a small dispatcher over the command modules in :mod:`hf_ext.commands`.

Each command module follows accelerate's pattern: ``<name>_command_parser(subparsers)`` adds its parser and sets
``func``; ``<name>_command(args)`` runs it and returns the exit code. Adding a command is one line in ``COMMANDS``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# "module:parser function" of every top-level command.
COMMANDS = [
    "hf_ext.commands.ds:ds_command_parser",
    "hf_ext.commands.export:export_command_parser",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser("hf-ext", description="hf-ext: DeepSpeed fine-tuning helpers for the HF Trainer.")
    subparsers = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND")
    for entry in COMMANDS:
        module, function = entry.split(":")
        getattr(importlib.import_module(module), function)(subparsers)
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

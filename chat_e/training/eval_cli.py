"""``chat-e eval``'s command line, light to import (``chat-e --help`` reads it): the report itself is
:mod:`chat_e.training.evaluate`."""

from __future__ import annotations

import argparse
import os
import sys

#: the module that writes the report
EVAL_MODULE = "chat_e.training.evaluate"
DESCRIPTION = (
    "An offline adherence report of a model, or of two side by side (paired differences with 95 % intervals): "
    "Chat-E mode adherence, verifiable instructions (strict and loose), the human-reply NLL on held-out chit-chat, "
    "and reply length, distinct-2 and the shares of empty and runaway replies. No judge model, no Hub."
)


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    """``chat-e eval``'s flags on ``parser``."""
    parser.add_argument(
        "--model",
        action="append",
        required=True,
        metavar="DIR",
        help="A model directory; twice for two models (the second compared with the first).",
    )
    parser.add_argument("--output_dir", default="runs/eval", help="Where the report goes (default runs/eval).")
    parser.add_argument(
        "--dataset",
        default="chitchat+chatterbot",
        help="The offline corpus whose validation split's human replies are scored: chitchat, "
        "chatterbot or chitchat+chatterbot (default: make demo's).",
    )
    parser.add_argument("--n_nll", type=int, default=128, help="Held-out human replies scored (default 128).")
    parser.add_argument("--seed", type=int, default=42, help="The corpus split's and the sample's seed (make demo's).")
    parser.add_argument("--max_source_length", type=int, default=96, help="Context tokens kept (make demo's).")
    parser.add_argument("--max_target_length", type=int, default=32, help="Human-reply tokens kept (make demo's).")
    parser.add_argument("--max_new_tokens", type=int, default=48, help="Longest generated reply (default 48).")
    parser.add_argument("--batch_size", type=int, default=16, help="Prompts per generate call (default 16).")
    parser.add_argument(
        "--quantize",
        choices=("auto", "none", "int8"),
        default="auto",
        help="As chat-e serve: auto (default) is int8 for fp32 weights.",
    )


def command(argv: list[str]) -> list[str]:
    """The process ``chat-e eval ARGV`` becomes: the report's module in this Python (the model code stays out of
    ``chat-e``'s process, as ``chat-e train``'s does)."""
    return [sys.executable, "-m", EVAL_MODULE, *argv]


def check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """The parsed flags' refusals, each one line naming the fix."""
    if len(args.model) > 2:
        parser.error(f"give one or two --model, not {len(args.model)}.")
    for name in ("n_nll", "max_new_tokens", "batch_size", "max_source_length", "max_target_length"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, not {getattr(args, name)}.")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser, argv: list[str]) -> int:
    """Check the parsed ``chat-e eval`` ``args``, then replace this process with the report's (``argv``: the flags
    as given)."""
    check(args, parser)
    cmd = command(argv)
    os.execv(cmd[0], cmd)
    return 0  # not reached: exec does not return

"""``hf-ext convert CHECKPOINT OUT --to fsdp2|deepspeed``: parsing only; the work is
:func:`hf_ext.saving.convert.convert_checkpoint`."""

from __future__ import annotations

import argparse
import logging
import sys

from ..atomic import write_failure

CONVERT_HELP = (
    "Convert a Trainer checkpoint between DeepSpeed ZeRO and FSDP2 (weights, optimizer state, schedule, RNG, data "
    "position), through DeepSpeed's universal checkpoint; either side on any number of ranks."
)


def convert_command_parser(subparsers):
    parser = subparsers.add_parser("convert", help=CONVERT_HELP, description=CONVERT_HELP)
    parser.add_argument("checkpoint", help="a checkpoint-N directory written by a DeepSpeed (ZeRO 1-3) or FSDP2 run")
    parser.add_argument("out", help="a new directory for the converted checkpoint (resume_from_checkpoint=OUT)")
    parser.add_argument("--to", required=True, choices=("fsdp2", "deepspeed"), help="the engine that resumes it")
    parser.set_defaults(func=convert_command)
    return parser


def convert_command(args: argparse.Namespace) -> int:
    from ..saving.convert import ConvertError, convert_checkpoint  # noqa: PLC0415 (torch, DeepSpeed: once it runs)

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        out = convert_checkpoint(args.checkpoint, args.out, args.to)
    except (ConvertError, RuntimeError) as err:
        print(f"hf-ext convert: {err}", file=sys.stderr)
        return 1
    except Exception as err:  # a full disk, no permission: nothing of OUT was written
        reason = write_failure(err)
        if reason is None:
            raise
        print(f"hf-ext convert: could not write {args.out} ({reason}); nothing was written.", file=sys.stderr)
        return 1
    print(out)
    return 0

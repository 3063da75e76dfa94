"""``hf-ext ds``: DeepSpeed config commands.

* ``hf-ext ds resolve CONFIG [--model PATH] [--world_size N] [TrainingArguments flags]`` prints the resolved config
  as JSON, then a table of every filled or normalized key and where its value came from.
* ``hf-ext ds doctor CONFIG [same options]`` prints one line per problem and warning; exits 1 on errors, 0 otherwise.

CONFIG is a JSON file, an accelerate YAML or a preset name. User errors are reported in one line each, without a
traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from types import SimpleNamespace

from ..deepspeed.load import load
from ..errors import DeepSpeedConfigError, Report
from .common import quiet_logging
from .plan import plan_command_parser

RESOLVE_HELP = "Print the resolved DeepSpeed config (JSON), then every filled/normalized key and its source."
DOCTOR_HELP = "Check a DeepSpeed config: one line per problem; exit 1 on errors, 0 otherwise."


def _common(parser: argparse.ArgumentParser):
    parser.add_argument(
        "config", help="DeepSpeed JSON, accelerate YAML, or preset (zero1, zero2, zero3, zero3_offload)"
    )
    parser.add_argument("--model", default=None, help="model path or hub id, for the hidden-size based bucket sizes")
    parser.add_argument("--world_size", type=int, default=None, help="number of ranks (default: 1)")
    parser.add_argument(
        "--sp_size",
        type=int,
        default=1,
        help="Ulysses sequence-parallel size: the run's "
        'ParallelismConfig(sp_size=N, sp_backend="deepspeed") (default: 1, none)',
    )
    parser.set_defaults(accepts_extra=True)  # the remaining flags are TrainingArguments flags


def resolve_command_parser(subparsers):
    parser = subparsers.add_parser(
        "resolve",
        help=RESOLVE_HELP,
        description=RESOLVE_HELP + " Other flags are "
        "TrainingArguments flags (--per_device_train_batch_size 4 --bf16 --max_steps 100 ...).",
    )
    _common(parser)
    parser.set_defaults(func=resolve_command)
    return parser


def doctor_command_parser(subparsers):
    parser = subparsers.add_parser("doctor", help=DOCTOR_HELP, description=DOCTOR_HELP)
    _common(parser)
    parser.set_defaults(func=doctor_command)
    return parser


SUBCOMMANDS = [resolve_command_parser, doctor_command_parser, plan_command_parser]


def ds_command_parser(subparsers=None):
    parser = (
        subparsers.add_parser("ds", help="DeepSpeed config: resolve, doctor")
        if subparsers is not None
        else argparse.ArgumentParser("hf-ext ds")
    )
    ds_subparsers = parser.add_subparsers(title="ds commands", dest="ds_command", metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(ds_subparsers)
    parser.set_defaults(func=lambda args: _usage(parser))
    return parser


def _usage(parser) -> int:
    parser.print_help(sys.stderr)
    return 2


def _training_args(extra: list[str]):
    """hf-ext TrainingArguments from the remaining command-line flags; ``None`` and a message on a bad flag."""
    from transformers import HfArgumentParser  # noqa: PLC0415 (torch and transformers: once the config was read)

    from ..training_args import TrainingArguments  # noqa: PLC0415 (as above)

    parser = HfArgumentParser(TrainingArguments)
    try:
        (args, rest) = parser.parse_args_into_dataclasses(args=extra, return_remaining_strings=True)
    except SystemExit:
        return None, "invalid TrainingArguments flags: " + " ".join(extra)
    except ValueError as err:
        return None, f"invalid TrainingArguments: {err}"
    if rest:
        return None, f"unrecognized arguments: {' '.join(rest)}"
    return args, ""


def _parallelism(args):
    """The run's accelerate ``ParallelismConfig`` from ``--sp_size`` (``None``: none)."""
    if args.sp_size <= 1:
        return None
    from accelerate.parallelism_config import ParallelismConfig  # noqa: PLC0415 (torch: once the config was read)

    return ParallelismConfig(sp_size=args.sp_size, sp_backend="deepspeed")


def _explain(args, command: str, **kwargs):
    # a file that cannot be read as a DeepSpeed config is said at once, before torch and transformers are imported
    # (DeepSpeedConfigError); reading it again below keeps one path for everything else
    load(args.config, Report())
    from ..deepspeed.resolve import explain_deepspeed_config  # noqa: PLC0415 (torch, transformers, DeepSpeed)

    quiet_logging()
    training_args, error = _training_args(args.extra)
    if training_args is None:
        print(f"hf-ext ds {command}: error: {error}", file=sys.stderr)
        return None
    training_args.parallelism_config = _parallelism(args)  # a field HfArgumentParser cannot fill from a flag
    return explain_deepspeed_config(args.config, training_args, args.model, args.world_size or 1, **kwargs)


def resolve_command(args) -> int:
    try:
        resolution = _explain(args, "resolve")
    except DeepSpeedConfigError as err:
        print(f"hf-ext ds resolve: error: {err}", file=sys.stderr)
        return 1
    except OSError as err:  # e.g. --model pointing nowhere
        print(f"hf-ext ds resolve: error: {err}", file=sys.stderr)
        return 1
    if resolution is None:
        return 2
    for warning in resolution.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(json.dumps(resolution.config, indent=2))
    print()
    print(f"# {len(resolution.changes)} keys filled or normalized ({resolution.origin}):")
    print(resolution.table())
    for name, value in resolution.args_updates.items():
        print(f"# TrainingArguments.{name} = {value!r} (implied by the config)")
    return 0


def doctor_command(args) -> int:
    from .. import loss as losses  # noqa: PLC0415 (torch: once the config was read)
    from ..deepspeed import versions  # noqa: PLC0415 (once the config was read)

    try:
        resolution = _explain(args, "doctor", defer=True, raise_errors=False)
    except DeepSpeedConfigError as err:  # the file itself: one line per problem
        for problem in err.problems:
            print(f"error: {problem}")
        return 1
    except OSError as err:
        print(f"error: {err}")
        return 1
    if resolution is None:
        return 2
    if resolution.config:  # the run's other version rules: those of the arguments, not of the config
        run = SimpleNamespace(parallelism_config=_parallelism(args), deepspeed=resolution.config)
        if (factor := losses.ulysses_gradient_factor(run, versions.installed())) > 1:
            resolution.version_rules.append(losses.ulysses_rule(factor))
    for problem in resolution.problems:
        print(f"error: {problem}")
    for warning in resolution.warnings:
        print(f"warning: {warning}")
    if not resolution.problems and not resolution.warnings:
        print(f"ok: {resolution.origin} resolves cleanly ({len(resolution.changes)} keys filled or normalized)")
    if resolution.version_rules or not (resolution.problems or resolution.warnings):
        # the releases it was checked against, where they decided something (or all is well): one line per other error
        print(f"versions: {versions.describe(versions.installed())}")
        for rule in resolution.version_rules:
            print(f"version rule: {rule}")
    return 1 if resolution.problems else 0

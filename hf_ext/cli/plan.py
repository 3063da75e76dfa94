"""``hf-ext ds plan`` (parsing only; the work is :mod:`hf_ext.memory.report`): which ZeRO stage, offload and micro-batch fit the memory of each rank.

    hf-ext ds plan --model PATH --world_size N [--memory_per_device 8GB] [--seq_len 128] [--gradient_checkpointing]
        [--micro_batch N] [--precision fp32|bf16|fp16] [--device cpu|cuda] [--json]

Prints one row per configuration (stage x offload): the largest micro-batch that fits and the predicted memory per
rank at it (and at ``--micro_batch`` when given); the recommendation — the least-sharded configuration that fits
``--micro_batch``, or without it the one that fits the largest micro-batch — is marked with ``*``. ``--json`` prints
the same as JSON. The model's weights are not read: a random-init copy of its architecture is probed.
"""

from __future__ import annotations

import json
import sys

from .common import quiet_logging

PLAN_HELP = "Predict per-rank memory for each ZeRO stage / offload / micro-batch and recommend one."


def plan_command_parser(subparsers):
    parser = subparsers.add_parser("plan", help=PLAN_HELP, description=PLAN_HELP)
    parser.add_argument("--model", required=True, help="model path or hub id (only its config is read)")
    parser.add_argument("--world_size", type=int, default=1, help="number of ranks (default: 1)")
    parser.add_argument(
        "--nproc_per_node",
        type=int,
        default=None,
        help="ranks sharing one node's memory (default: --world_size, i.e. one node)",
    )
    parser.add_argument("--memory_per_device", default=None, help="per-rank budget, e.g. 8GB (default: detected)")
    parser.add_argument("--seq_len", type=int, default=128, help="tokens per example (default: 128)")
    parser.add_argument("--micro_batch", type=int, default=None, help="plan this micro-batch (default: the largest)")
    parser.add_argument(
        "--gradient_checkpointing",
        "--activation_checkpointing",
        dest="checkpointing",
        action="store_true",
        help="activation checkpointing on",
    )
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default=None, help="default: hardware's")
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=None,
        help="plan for this kind of device (default: this host's; another needs --memory_per_device)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=plan_command)
    return parser


def plan_command(args) -> int:
    from ..memory.report import format_table, jsonable, run_plan  # noqa: PLC0415 (torch: only once a command runs)

    quiet_logging()
    try:
        result = run_plan(
            args.model,
            args.world_size,
            args.memory_per_device,
            args.seq_len,
            args.micro_batch,
            args.checkpointing,
            args.precision,
            args.nproc_per_node,
            args.device,
        )
    except (OSError, ValueError) as err:
        print(f"hf-ext ds plan: error: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(jsonable(result), indent=2, default=str))
    else:
        print(format_table(result))
    return 0

"""``hf-ext fsdp doctor FSDP [--fsdp_config JSON] [--world_size N] [--ranks_per_node M]``: the FSDP settings checked
as ``TrainingArguments`` will check them, one line per problem or warning, then what they resolve to.
``hf-ext fsdp doctor --accelerate_config FILE``: the same for an ``accelerate launch`` config file (whose unknown
``fsdp_config`` keys accelerate itself ignores without a word). Exit 1 on errors, 0 otherwise."""

from __future__ import annotations

import json

from ..errors import FsdpConfigError

DOCTOR_HELP = (
    "Check FSDP settings (an fsdp value and fsdp_config, or an accelerate config file): one line per problem; "
    "exit 1 on errors."
)


def fsdp_command_parser(subparsers):
    parser = subparsers.add_parser("fsdp", help="FSDP settings: doctor")
    sub = parser.add_subparsers(title="fsdp commands", dest="fsdp_command", metavar="COMMAND", required=True)
    doctor = sub.add_parser("doctor", help=DOCTOR_HELP, description=DOCTOR_HELP)
    doctor.add_argument(
        "fsdp",
        nargs="?",
        default=None,
        help="the fsdp value: full_shard, hybrid_shard, no_shard, shard_grad_op [offload]",
    )
    doctor.add_argument(
        "--accelerate_config",
        default=None,
        help="an accelerate launch config file (distributed_type: FSDP) to check instead",
    )
    doctor.add_argument("--fsdp_config", default=None, help="a JSON file, or inline JSON")
    doctor.add_argument("--world_size", type=int, default=1, help="number of ranks (default: 1)")
    doctor.add_argument("--ranks_per_node", type=int, default=None, help="default: all ranks on one node")
    doctor.set_defaults(func=doctor_command)
    return parser


def doctor_command(args) -> int:
    from ..fsdp.config import resolve_accelerate_config, resolve_fsdp  # noqa: PLC0415 (accelerate: only once a command runs)
    from ..runtime import has_accelerator  # noqa: PLC0415 (torch: only once a command runs)

    if (args.fsdp is None) == (args.accelerate_config is None):
        print("error: pass an fsdp value (e.g. full_shard) or --accelerate_config FILE, one of them")
        return 1
    if args.accelerate_config is not None:
        try:
            resolution, args.world_size = resolve_accelerate_config(
                args.accelerate_config, has_accelerator=has_accelerator()
            )
        except FsdpConfigError as err:
            for problem in err.problems:
                print(f"error: {problem}")
            return 1
        return report(resolution, args.world_size)
    config = args.fsdp_config
    if config is not None and config.lstrip().startswith("{"):
        try:
            config = json.loads(config)
        except json.JSONDecodeError as err:
            print(f"error: fsdp_config: not valid JSON ({err}). Fix: quote it as '{{\"key\": value}}'")
            return 1
    try:
        resolution = resolve_fsdp(
            args.fsdp,
            config,
            world_size=args.world_size,
            local_world_size=args.ranks_per_node or args.world_size,
            has_accelerator=has_accelerator(),
        )
    except FsdpConfigError as err:
        for problem in err.problems:
            print(f"error: {problem}")
        return 1
    return report(resolution, args.world_size)


def report(resolution, world_size: int) -> int:
    for warning in resolution.warnings:
        print(f"warning: {warning}")
    engine = "DDP" if resolution.fsdp is None else "FSDP2"
    print(
        f"ok: {resolution.sharding} on {world_size} ranks runs {engine}: each parameter split over "
        f"{resolution.sharding_factor} rank(s), {resolution.replicas} replica(s) of each shard"
    )
    for change in resolution.changes:
        print(f"  {change.key} = {json.dumps(change.value)} ({change.source})")
    return 0

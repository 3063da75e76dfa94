"""``hf-ext ds plan``: which ZeRO stage, offload and micro-batch fit the memory of each rank.

    hf-ext ds plan --model PATH --world_size N [--memory_per_device 8GB] [--seq_len 128] [--gradient_checkpointing]
        [--micro_batch N] [--precision fp32|bf16|fp16] [--json]

Prints one row per configuration (stage x offload): the largest micro-batch that fits and the predicted memory per
rank at it (and at ``--micro_batch`` when given); the recommendation — the least-sharded configuration that fits
``--micro_batch``, or without it the one that fits the largest micro-batch — is marked with ``*``. ``--json`` prints
the same as JSON. The model's weights are not read: a random-init copy of its architecture is probed.
"""

from __future__ import annotations

import json
import sys

PLAN_HELP = "Predict per-rank memory for each ZeRO stage / offload / micro-batch and recommend one."


def plan_command_parser(subparsers):
    parser = subparsers.add_parser("plan", help=PLAN_HELP, description=PLAN_HELP)
    parser.add_argument("--model", required=True, help="model path or hub id (only its config is read)")
    parser.add_argument("--world_size", type=int, default=1, help="number of ranks (default: 1)")
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
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=plan_command)
    return parser


def run_plan(model, world_size: int, memory_per_device=None, seq_len: int = 128, micro_batch: int | None = None,
             checkpointing: bool = False, precision: str | None = None) -> dict:  # fmt: skip
    """The plans of every candidate and the recommendation, as a dict (what ``--json`` prints)."""
    from .. import planner
    from ..deepspeed_config import Hardware, hidden_size_of
    from ..memory import current_rss
    from ..plan_auto import detect_budget, from_measurement, measure, parse_bytes

    hardware = Hardware.detect()
    precision = precision or hardware.default_precision() or "fp32"
    baseline = current_rss() if hardware.device == "cpu" else planner.GPU_RESERVE
    if memory_per_device:
        budget = parse_bytes(memory_per_device)
    elif hardware.device == "cpu":
        import psutil

        budget = int(psutil.virtual_memory().available // max(1, world_size))
    else:
        budget = detect_budget(hardware.device)
    facts, profile = from_measurement(measure(model, seq_len, checkpointing))
    hidden = hidden_size_of(model)
    zero = {"reduce_bucket_size": hidden * hidden} if hidden else {}
    common = dict(precision=precision, device=hardware.device, baseline=baseline)
    rows = []
    candidates = [planner.Candidate(0, ddp=True), *planner.CANDIDATES]
    for c in candidates:
        best = planner.max_micro_batch(c, facts, profile, world_size, budget, zero=zero, **common)
        at = best or micro_batch or 1
        row = {"config": c.name, "max_micro_batch": best,
               "plan_at_max": planner.plan(c, facts, profile, world_size, at, zero=zero, budget=budget, **common)}  # fmt: skip
        if micro_batch:
            row["plan_at_micro_batch"] = planner.plan(
                c, facts, profile, world_size, micro_batch, zero=zero, budget=budget, **common
            )
        rows.append(row)
    chosen, _ = planner.choose(facts, profile, world_size, budget, micro_batch, zero=zero, **common)
    return {
        "model": str(model),
        "num_params": facts.num_params,
        "world_size": world_size,
        "seq_len": seq_len,
        "precision": precision,
        "device": hardware.device,
        "activation_checkpointing": checkpointing,
        "budget_bytes": budget,
        "baseline_bytes": baseline,
        "error_band": {"relative": planner.ERROR_BAND, "absolute_bytes": planner.ERROR_FLOOR},
        "activations": {"points": profile.points, "per_sample": profile.per_sample, "fixed": profile.fixed},
        "recommended": chosen.candidate.name if chosen else None,
        "recommended_micro_batch": chosen.micro_batch if chosen else None,
        "rows": rows,
    }


def _jsonable(result: dict) -> dict:
    out = dict(result)
    out["rows"] = [
        {k: (v.to_dict() if hasattr(v, "to_dict") else v) for k, v in row.items()} for row in result["rows"]
    ]
    return out


def format_table(result: dict) -> str:
    from ..memory import gb

    head = ["", "config", "max micro-batch", "GiB/rank at max"]
    if any("plan_at_micro_batch" in r for r in result["rows"]):
        head.append(f"GiB/rank at {result['rows'][0]['plan_at_micro_batch'].micro_batch}")
    lines = [head]
    for row in result["rows"]:
        mark = "*" if row["config"] == result["recommended"] else ""
        p = row["plan_at_max"]
        cells = [mark, row["config"], str(row["max_micro_batch"] or "does not fit"),
                 f"{(p.total_bytes + p.baseline) / 2**30:.2f}"]  # fmt: skip
        if "plan_at_micro_batch" in row:
            q = row["plan_at_micro_batch"]
            cells.append(f"{(q.total_bytes + q.baseline) / 2**30:.2f}" + ("" if q.fits else " (no)"))
        if p.notes:
            cells.append("; ".join(p.notes))
        lines.append(cells)
    widths = [max(len(r[i]) for r in lines if i < len(r)) for i in range(len(head))]
    text = "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() + ("  " + r[-1] if len(r) > len(head) else "") for r in lines)  # fmt: skip
    summary = (
        f"{result['model']}: {result['num_params']:,} parameters, {result['world_size']} rank(s), "
        f"{result['seq_len']} tokens, {result['precision']} on {result['device']}, activation checkpointing "
        f"{'on' if result['activation_checkpointing'] else 'off'}; budget {gb(result['budget_bytes'])} per rank "
        f"(process baseline {gb(result['baseline_bytes'])} included in the GiB columns)"
    )
    band = result["error_band"]
    footer = (
        f"* recommended: {result['recommended']} at micro-batch {result['recommended_micro_batch']}"
        if result["recommended"]
        else "* nothing fits: lower --seq_len, add --gradient_checkpointing or ranks, or raise --memory_per_device"
    )
    footer += f"\nstated error band: ±{band['relative']:.0%} + {gb(band['absolute_bytes'])} of the prediction"
    return f"{summary}\n\n{text}\n\n{footer}"


def plan_command(args) -> int:
    from .ds import _quiet

    _quiet()
    try:
        result = run_plan(args.model, args.world_size, args.memory_per_device, args.seq_len, args.micro_batch,
                          args.checkpointing, args.precision)  # fmt: skip
    except (OSError, ValueError) as err:
        print(f"hf-ext ds plan: error: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(_jsonable(result), indent=2, default=str))
    else:
        print(format_table(result))
    return 0

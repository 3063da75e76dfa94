"""The memory plan of every ZeRO stage / offload for a model, as data and as the table ``hf-ext ds plan`` prints.

The model's weights are not read: a random-init copy of its architecture is probed. The per-rank budget follows the
same rule as ``"auto"`` in a config (:func:`hf_ext.memory.auto.detect_budget`).
"""

from __future__ import annotations

from ..runtime import Hardware
from ..sizes import gb, parse_bytes
from . import formulas
from .auto import detect_budget, process_baseline
from .probe import from_measurement, measure


def run_plan(
    model,
    world_size: int,
    memory_per_device=None,
    seq_len: int = 128,
    micro_batch: int | None = None,
    checkpointing: bool = False,
    precision: str | None = None,
    nproc_per_node: int | None = None,
    device: str | None = None,
    zero: dict | None = None,
) -> dict:
    """The plans of every candidate and the recommendation, as a dict (what ``--json`` prints).

    ``device`` plans for another kind of host than this one (``cuda`` from a CPU machine, say): its budget must then
    be given, and the precision defaults to fp32 unless given. ``zero``: the ``zero_optimization`` sizes to plan with
    (DeepSpeed's defaults, with the hidden-size based bucket sizes of an "auto" config, where not given; on a CPU-only
    host, the ZeRO-3 sizes hf-ext's presets use there).
    """
    hardware = Hardware.detect()
    if device is not None and device != hardware.device:
        if memory_per_device is None:
            raise ValueError(
                f"planning for {device} on a {hardware.device} host needs --memory_per_device (e.g. 80GB)"
            )
        precision = precision or "fp32"
    else:
        device = hardware.device
        precision = precision or hardware.default_precision() or "fp32"
    baseline = process_baseline(device)
    local_ranks = nproc_per_node or world_size  # ranks sharing this node's memory (default: one node)
    budget = parse_bytes(memory_per_device) if memory_per_device else detect_budget(device, local_ranks)
    facts, profile = from_measurement(measure(model, seq_len, checkpointing))
    if zero is None and device == "cpu":  # what hf-ext's ZeRO-3 presets run with on a CPU-only host
        zero = {key: formulas.CPU_ZERO3_GRANULARITY for key in formulas.CPU_ZERO3_KEYS}
    zero = dict(zero or {})
    common = dict(precision=precision, device=device, baseline=baseline)
    rows = []
    candidates = [formulas.Candidate(0, ddp=True), *formulas.CANDIDATES, formulas.FSDP_FULL_SHARD]
    for c in candidates:
        best = formulas.max_micro_batch(c, facts, profile, world_size, budget, zero=zero, **common)
        at = best or micro_batch or 1
        row = {
            "config": c.name,
            "max_micro_batch": best,
            "plan_at_max": formulas.plan(c, facts, profile, world_size, at, zero=zero, budget=budget, **common),
        }
        if micro_batch:
            row["plan_at_micro_batch"] = formulas.plan(
                c, facts, profile, world_size, micro_batch, zero=zero, budget=budget, **common
            )
        rows.append(row)
    chosen, _ = formulas.choose(facts, profile, world_size, budget, micro_batch, zero=zero, **common)
    # the engine for the micro-batch asked for (1 when none): the least sharded that fits it
    engine, _ = formulas.choose(
        facts, profile, world_size, budget, micro_batch or 1, formulas.ENGINES, zero=zero, **common
    )
    return {
        "model": str(model),
        "num_params": facts.num_params,
        "world_size": world_size,
        "seq_len": seq_len,
        "precision": precision,
        "device": device,
        "activation_checkpointing": checkpointing,
        "budget_bytes": budget,
        "baseline_bytes": baseline,
        "error_band": {"relative": formulas.ERROR_BAND, "absolute_bytes": formulas.ERROR_FLOOR},
        "activations": {"points": profile.points, "per_sample": profile.per_sample, "fixed": profile.fixed},
        "recommended": chosen.candidate.name if chosen else None,
        "recommended_micro_batch": chosen.micro_batch if chosen else None,
        "engine": engine.candidate.name if engine else None,
        "engine_micro_batch": micro_batch or 1,
        "rows": rows,
    }


def jsonable(result: dict) -> dict:
    out = dict(result)
    out["rows"] = [
        {k: (v.to_dict() if hasattr(v, "to_dict") else v) for k, v in row.items()} for row in result["rows"]
    ]
    return out


def format_table(result: dict) -> str:
    head = ["", "config", "max micro-batch", "GiB/rank at max"]
    if any("plan_at_micro_batch" in r for r in result["rows"]):
        head.append(f"GiB/rank at {result['rows'][0]['plan_at_micro_batch'].micro_batch}")
    head.append("gathered eval GiB")
    lines = [head]
    for row in result["rows"]:
        mark = "*" if row["config"] == result["recommended"] else ""
        p = row["plan_at_max"]
        cells = [
            mark,
            row["config"],
            str(row["max_micro_batch"] or "does not fit"),
            f"{(p.total_bytes + p.baseline) / 2**30:.2f}",
        ]
        if "plan_at_micro_batch" in row:
            q = row["plan_at_micro_batch"]
            cells.append(f"{(q.total_bytes + q.baseline) / 2**30:.2f}" + ("" if q.fits else " (no)"))
        # ZeRO-3 only: a full copy of the weights for generation eval, beside the training state
        cells.append(
            f"{p.gathered_eval_bytes / 2**30:.2f}" + ("" if p.gathered_eval_fits else " (no)")
            if p.gathered_eval_bytes
            else "-"
        )
        if p.notes:
            cells.append("; ".join(p.notes))
        lines.append(cells)
    widths = [max(len(r[i]) for r in lines if i < len(r)) for i in range(len(head))]
    text = "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() + ("  " + r[-1] if len(r) > len(head) else "")
        for r in lines
    )
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
    footer += (
        f"\nengine for micro-batch {result['engine_micro_batch']}: {result['engine'] or 'none fits'} (the least "
        'sharded that fits it; docs/memory.md, "Which engine?")'
    )
    footer += f"\nstated error band: ±{band['relative']:.0%} + {gb(band['absolute_bytes'])} of the prediction"
    footer += (
        "\ngathered eval: the extra peak of a ZeRO-3 generation eval that gathers the weights once "
        "(generation_gather_weights); (no): it falls back to per-token gathers"
    )
    return f"{summary}\n\n{text}\n\n{footer}"

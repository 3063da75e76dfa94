"""The largest micro-batch that fits a fixed per-rank memory budget: DDP vs ZeRO-2 vs ZeRO-3, with and without
activation checkpointing (the blog's "max train batch" column, on this hardware), each found by measurement and
set beside the planner's prediction.

    python -m benchmarks.bench_max_batch --size 400m --budget_gib 8 --seq_len 128 --predict_only on \
        --out runs/bench/max_batch_400m.json

For every configuration the planner (``hf_ext.memory.formulas.max_micro_batch``, on the config hf-ext resolves for
this host) predicts the largest micro-batch whose per-rank peak fits ``--budget_gib`` (process baseline included).
The bench then measures: one 2-rank training launch (benchmarks.worker, hf-ext path, ``--steps`` steps) at the
predicted micro-batch; while every launch's measured peak RSS (larger rank) fits the budget it grows the micro-batch
by ``--growth``, then bisects between the largest fitting and the smallest non-fitting one until they are
``--resolution`` apart (relative) or ``--max_launches`` is spent. The budget is enforced by measured peak RSS (the
kernel's high-water mark of each rank), not by a cgroup: a run whose peak exceeds the budget counts as "does not
fit" exactly as an OOM would.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

from benchmarks import harness
from benchmarks.bench_memory import LABELS, RELEASE, planned_setup, planner_inputs
from benchmarks.harness import GiB

MODULE = "benchmarks.bench_max_batch"
CONFIGS = ("ddp", "zero2", "zero3", "fsdp")
BASELINE_GUESS = int(0.45 * GiB)  # a rank's RSS before its model exists (the workers' baseline_bytes)


def predict(
    name: str, model: Path, facts, profile, budget: int, baseline: int, bf16: bool = False
) -> tuple[int, object]:
    from hf_ext.memory import formulas

    candidate, zero, precision = planned_setup(name, model, bf16=bf16)
    common = dict(precision=precision, zero=zero, baseline=baseline)
    batch = formulas.max_micro_batch(candidate, facts, profile, 2, budget, **common)
    return batch, formulas.plan(candidate, facts, profile, 2, max(1, batch), budget=budget, **common)


def plan_launches(name: str, model: Path, facts, profile, runs: list[dict], bf16: bool = False) -> None:
    """Put the planner's peak (its plan at the launch's micro-batch above the launch's measured baseline) beside
    each measured launch's peak, in place."""
    from hf_ext.memory import formulas

    candidate, zero, precision = planned_setup(name, model, bf16=bf16)
    for run in runs:
        if "peak_bytes" in run:
            plan = formulas.plan(candidate, facts, profile, 2, run["batch"], precision=precision, zero=zero)
            run["planned_peak_bytes"] = run["baseline_bytes"] + plan.total_bytes


def search(name: str, ckpt: bool, start: int, budget: int, model: Path, opts, work: Path, need: int) -> dict:
    """Measure micro-batches around ``start`` until the largest fitting one is bracketed (see module docstring)."""
    fit, nofit, runs = 0, None, []
    batch = max(1, start)
    while len(runs) < opts.max_launches:
        free, waited = harness.available_memory(), time.time()
        while free < need and time.time() - waited < 90:  # the last launch's memory may still be on its way back
            time.sleep(5)
            free = harness.available_memory()
        if free < need:
            runs.append({"batch": batch, "skipped": f"{free / GiB:.1f} GiB available, {need / GiB:.1f} needed"})
            nofit = batch if nofit is None else min(nofit, batch)
        else:
            out = Path(f"{work}_{name}{'_bf16' * opts.bf16}_ckpt{int(ckpt)}_b{batch}")
            started = time.time()
            args = ["--model", str(model), "--config", name, "--path", "hf-ext", "--batch", str(batch)]
            args += ["--seq_len", str(opts.seq_len), "--steps", str(opts.steps), *RELEASE]
            args += ["--activation_checkpointing"] * ckpt + ["--bf16"] * opts.bf16
            args += ["--from_config"] * (not harness.has_weights(model))  # a config-only model (CLASSIFIERS)
            launcher = "torchrun" if name in ("ddp", "fsdp") else "deepspeed"
            result = harness.launch_worker(args, out, launcher=launcher, reuse=opts.reuse)
            run = {"batch": batch, "seconds": round(time.time() - started, 1)}
            if isinstance(result, str):
                run.update(error=result, fits=False)
            else:
                run["peak_bytes"] = max(r["peak_bytes"] for r in result)
                run["baseline_bytes"] = max(r["baseline_bytes"] for r in result)
                run["fits"] = run["peak_bytes"] <= budget
            runs.append(run)
            print(json.dumps({"config": name, "checkpointing": ckpt, **run})[:400], flush=True)
            if run["fits"]:
                fit = max(fit, batch)
            else:
                nofit = batch if nofit is None else min(nofit, batch)
        step = max(1, math.ceil(opts.resolution * max(fit, 1)))
        if nofit is not None and nofit - fit <= step:
            break
        if nofit is None:  # everything tried fits: grow geometrically until one does not
            batch = max(fit + step, math.ceil(fit * opts.growth))
        elif fit == 0:  # nothing tried fits yet: halve
            if nofit <= 1:
                break
            batch = nofit // 2
        else:
            batch = (fit + nofit) // 2
    return {"measured_max": fit, "first_not_fitting": nofit, "runs": runs}


def launch_cell(run: dict) -> str:
    if "peak_bytes" not in run:
        return f"{run['batch']}: {'skipped' if 'skipped' in run else 'failed (OOM-killed or error)'}"
    planned = f" / {run['planned_peak_bytes'] / GiB:.2f}" if "planned_peak_bytes" in run else ""
    return f"{run['batch']}: {run['peak_bytes'] / GiB:.2f}{planned}"


def markdown(result: dict) -> str:
    o = result["settings"]
    precision = ", ".join(sorted({row["plan"]["precision"] for row in result["rows"]})) or "fp32"
    lines = [
        f"`{o['command']}` — {result['model']} ({result['num_params']:,} parameters), 2 CPU ranks, {precision} AdamW, "
        f"sequences of {o['seq_len']} tokens, {o['steps']} steps per launch, budget {o['budget_gib']} GiB per rank "
        f"(peak RSS of the larger rank, process included), {result['date']}. Measured = the largest micro-batch "
        "whose launch stayed within the budget; the next one tried exceeded it.",
        "",
    ]
    header = ["config", "activation checkpointing", "planner max micro-batch", "measured max micro-batch",
              "next tried (over budget)", "measured peak at max (GiB)", "vs DDP (measured)",
              "launches: micro-batch, measured / planned peak GiB"]  # fmt: skip
    rows = []
    for row in result["rows"]:
        ddp = next(
            (r for r in result["rows"] if r["config"] == "ddp" and r["checkpointing"] == row["checkpointing"]), None
        )
        best = next((r for r in row["runs"] if r.get("fits") and r["batch"] == row["measured_max"]), None)
        ratio = row["measured_max"] / ddp["measured_max"] if ddp and ddp["measured_max"] else None
        rows.append([
            LABELS[row["config"]],
            "on" if row["checkpointing"] else "off",
            str(row["predicted_max"]),
            "not measured" if row["measured_max"] is None else str(row["measured_max"]),
            str(row["first_not_fitting"] or "—"),
            f"{best['peak_bytes'] / GiB:.2f}" if best else "—",
            f"{ratio:.2f}" if ratio else "—",
            "; ".join(launch_cell(run) for run in sorted(row["runs"], key=lambda run: run["batch"])) or "none",
        ])  # fmt: skip
    lines.append(harness.markdown_table(header, rows))
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="400m", help=harness.SIZE_HELP)
    parser.add_argument("--model", default=None, help="model directory (default: runs/models/<size>)")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--checkpointing", nargs="+", default=["off", "on"], choices=["off", "on"])
    parser.add_argument(
        "--predict_only", nargs="*", default=[], choices=["off", "on"],
        help="checkpointing settings planned but not measured (e.g. 'on' where the fitting batches are too slow)",
    )  # fmt: skip
    parser.add_argument("--budget_gib", type=float, default=9.0, help="per-rank budget (peak RSS), GiB")
    parser.add_argument("--seq_len", type=int, default=32)
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision (fp32 master weights)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--resolution", type=float, default=0.125, help="relative gap between fit and no fit")
    parser.add_argument("--max_launches", type=int, default=5, help="launches per configuration at most")
    parser.add_argument("--growth", type=float, default=1.5, help="factor to the next micro-batch while all fit")
    parser.add_argument("--reuse", action="store_true", help="reuse launches an interrupted run left in --out's dir")
    parser.add_argument("--replan", action="store_true", help="only redo the planner's column of an existing --out")
    parser.add_argument("--margin_gib", type=float, default=1.0, help="free RAM kept beyond the two ranks")
    parser.add_argument("--out", default="runs/bench/max_batch.json")
    parser.add_argument("--docs", default=str(harness.DOCS), help="markdown file whose marked section is rewritten")
    parser.add_argument("--section", default="bench_max_batch", help="the section's marker name in --docs")
    opts = parser.parse_args(argv)

    model = harness.ensure_model(opts.size, opts.model)
    budget = int(opts.budget_gib * GiB)
    ckpts = tuple(c == "on" for c in opts.checkpointing)
    inputs = {ckpt: planner_inputs(model, opts.seq_len, ckpt) for ckpt in ckpts or (False,)}
    facts = next(iter(inputs.values()))[0]
    work = Path(opts.out).with_suffix("")
    work.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "model": os.path.relpath(model, harness.ROOT) if model.is_relative_to(harness.ROOT) else str(model),
        "num_params": facts.num_params,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "settings": {
            "budget_gib": opts.budget_gib,
            "seq_len": opts.seq_len,
            "steps": opts.steps,
            "resolution": opts.resolution,
            "command": harness.command(MODULE, argv),
        },
        "host": harness.host_info(),
        "rows": [],
    }
    need = 2 * budget + int(opts.margin_gib * GiB)  # free RAM for both ranks at the budget, plus a margin

    if opts.replan:  # the measured runs stay; the predictions are recomputed with the current planner
        old = json.loads(Path(opts.out).read_text())
        for row in old["rows"]:
            if row["checkpointing"] not in inputs:
                inputs[row["checkpointing"]] = planner_inputs(model, opts.seq_len, row["checkpointing"])
            facts, profile = inputs[row["checkpointing"]]
            predicted, plan = predict(row["config"], model, facts, profile, budget, BASELINE_GUESS, opts.bf16)
            row.update(predicted_max=predicted, plan=plan.to_dict())
            plan_launches(row["config"], model, facts, profile, row["runs"], opts.bf16)
        old["replanned"] = result["date"]
        result = old
        harness.write_json(opts.out, result)
        ckpts = ()
    for ckpt in ckpts:
        facts, profile = inputs[ckpt]
        for name in opts.configs:
            predicted, plan = predict(name, model, facts, profile, budget, BASELINE_GUESS, opts.bf16)
            row = {"config": name, "checkpointing": ckpt, "predicted_max": predicted, "plan": plan.to_dict()}
            if ("on" if ckpt else "off") in opts.predict_only:
                row.update(measured_max=None, first_not_fitting=None, runs=[])
            else:
                row.update(search(name, ckpt, predicted, budget, model, opts, work, need))
                plan_launches(name, model, facts, profile, row["runs"], opts.bf16)
            result["rows"].append(row)
            harness.write_json(opts.out, result)  # partial results survive
    harness.write_section(Path(opts.docs), opts.section, markdown(result))
    print(markdown(result))
    print(f"wrote {opts.out} and section '{opts.section}' of {opts.docs}")
    return result


if __name__ == "__main__":
    main()

"""The largest micro-batch that fits a fixed per-rank memory budget: DDP vs ZeRO-2 vs ZeRO-3, with and without
activation checkpointing (the blog's "max train batch" column, on this hardware), each found by measurement and
set beside the planner's prediction.

    python scripts/bench_max_batch.py --size 400m --budget_gib 8 --seq_len 128 --predict_only on --out runs/bench/max_batch_400m.json

For every configuration the planner (``hf_ext.planner.max_micro_batch``) predicts the largest micro-batch whose
per-rank peak fits ``--budget_gib`` (process baseline included). The script then measures: one 2-rank training launch
(``scripts/memory_worker.py``, hf-ext path, ``--steps`` steps) at the predicted micro-batch; while every launch's
measured peak RSS (larger rank) fits the budget it grows the micro-batch by ``--growth``, then bisects between the
largest fitting and the smallest non-fitting one until they are ``--resolution`` apart (relative) or
``--max_launches`` is spent.
The budget is enforced by measured peak RSS (the kernel's high-water mark of each rank), not by a cgroup: a run whose
peak exceeds the budget counts as "does not fit" exactly as an OOM would.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

from bench_memory import LABELS, RELEASE, GiB, available, launch, preset_zero, write_section  # noqa: E402

SECTION = "## Memory: largest micro-batch under a fixed budget"
CONFIGS = ("ddp", "zero2", "zero3")
BASELINE_GUESS = int(0.45 * GiB)  # RSS of a rank before the model exists (Python, torch, DeepSpeed), measured


def planner_inputs(model_dir: Path, seq_len: int, checkpointing: tuple[bool, ...]):
    """Model facts and one activation profile per checkpointing setting (a probe forward/backward each)."""
    import gc

    from transformers import AutoModelForSeq2SeqLM

    from hf_ext.memory import formulas as planner

    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir)
    facts = planner.model_facts(model)
    profiles = {ckpt: planner.probe_activations(model, seq_len, (1, 2), ckpt) for ckpt in checkpointing}
    del model
    gc.collect()
    return facts, profiles


def predict(name: str, facts, profile, budget: int, baseline: int) -> tuple[int, object]:
    from hf_ext.memory import formulas as planner

    zero = None if name == "ddp" else preset_zero(name, facts.hidden_size)
    candidate = planner.Candidate(0, ddp=True) if zero is None else planner.Candidate(zero["stage"])
    common = dict(zero=zero, baseline=baseline)
    batch = planner.max_micro_batch(candidate, facts, profile, 2, budget, **common)
    return batch, planner.plan(candidate, facts, profile, 2, max(1, batch), budget=budget, **common)


def search(name: str, ckpt: bool, start: int, budget: int, model: Path, opts, work: Path, need: int) -> dict:
    """Measure micro-batches around ``start`` until the largest fitting one is bracketed (see module docstring)."""
    fit, nofit, runs = 0, None, []
    batch = max(1, start)
    while len(runs) < opts.max_launches:
        free = available()
        if free < need:
            runs.append({"batch": batch, "skipped": f"{free / GiB:.1f} GiB available, {need / GiB:.1f} needed"})
            nofit = batch if nofit is None else min(nofit, batch)
        else:
            o = argparse.Namespace(batch=batch, seq_len=opts.seq_len, steps=opts.steps)
            extra = RELEASE + (("--activation_checkpointing",) if ckpt else ())
            out = Path(f"{work}_{name}_ckpt{int(ckpt)}_b{batch}")
            done = [Path(f"{out}.rank{r}.json") for r in (0, 1)]
            started = time.time()
            if opts.reuse and all(p.exists() for p in done):  # a launch of an earlier, interrupted run
                result = [json.loads(p.read_text()) for p in done]
            else:
                result = launch(model, name, "hf-ext", o, out, extra)
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


def markdown(result: dict) -> str:
    o = result["settings"]
    lines = [
        SECTION,
        "",
        f"`python scripts/bench_max_batch.py {o['cmdline']}` — {result['model']} ({result['num_params']:,} "
        f"parameters), 2 CPU ranks, fp32 AdamW, sequences of {o['seq_len']} tokens, {o['steps']} steps per launch, "
        f"budget {o['budget_gib']} GiB per rank (peak RSS of the larger rank, process included), {result['date']}. "
        "Measured = the largest micro-batch whose launch stayed within the budget; the next one tried exceeded it.",
        "",
        "| config | activation checkpointing | planner max micro-batch | measured max micro-batch | next tried (over budget) "
        "| measured peak at max (GiB) | vs DDP (measured) | launches |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        ddp = next((r for r in result["rows"] if r["config"] == "ddp" and r["checkpointing"] == row["checkpointing"]), None)  # fmt: skip
        best = next((r for r in row["runs"] if r.get("fits") and r["batch"] == row["measured_max"]), None)
        ratio = row["measured_max"] / ddp["measured_max"] if ddp and ddp["measured_max"] else None
        cells = [
            LABELS[row["config"]],
            "on" if row["checkpointing"] else "off",
            str(row["predicted_max"]),
            "not measured" if row["measured_max"] is None else str(row["measured_max"]),
            str(row["first_not_fitting"] or "—"),
            f"{best['peak_bytes'] / GiB:.2f}" if best else "—",
            f"{ratio:.2f}" if ratio else "—",
            str(len(row["runs"])),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="400m", help="tiny_model size to build when --model is not given")
    parser.add_argument("--model", default=None, help="model directory (default: runs/models/<size>)")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--checkpointing", nargs="+", default=["off", "on"], choices=["off", "on"])
    parser.add_argument(
        "--predict_only", nargs="*", default=[], choices=["off", "on"],
        help="checkpointing settings planned but not measured (e.g. 'on' where the fitting batches are too slow)",
    )  # fmt: skip
    parser.add_argument("--budget_gib", type=float, default=9.0, help="per-rank budget (peak RSS), GiB")
    parser.add_argument("--seq_len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--resolution", type=float, default=0.125, help="relative gap between fit and no fit")
    parser.add_argument("--max_launches", type=int, default=5, help="launches per configuration at most")
    parser.add_argument("--growth", type=float, default=1.5, help="factor to the next micro-batch while all fit")
    parser.add_argument("--reuse", action="store_true", help="reuse launches an interrupted run left in --out's dir")
    parser.add_argument("--replan", action="store_true", help="only redo the planner's column of an existing --out")
    parser.add_argument("--margin_gib", type=float, default=1.0, help="free RAM kept beyond the two ranks")
    parser.add_argument("--out", default="runs/bench/max_batch.json")
    parser.add_argument("--docs", default="docs/benchmarks.md")
    opts = parser.parse_args(argv)

    model = Path(opts.model or ROOT / "runs" / "models" / opts.size)
    if not (model / "config.json").exists():
        from chat_e.models import build

        build(str(model), opts.size, seed=0)
    budget = int(opts.budget_gib * GiB)
    ckpts = tuple(c == "on" for c in opts.checkpointing)
    facts, profiles = planner_inputs(model, opts.seq_len, ckpts)
    work = Path(opts.out).with_suffix("")
    work.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "model": str(model.relative_to(ROOT) if model.is_relative_to(ROOT) else model),
        "num_params": facts.num_params,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "settings": {
            "budget_gib": opts.budget_gib,
            "seq_len": opts.seq_len,
            "steps": opts.steps,
            "resolution": opts.resolution,
            "cmdline": " ".join(sys.argv[1:] if argv is None else argv),
        },
        "rows": [],
    }

    need = 2 * budget + int(opts.margin_gib * GiB)  # free RAM for both ranks at the budget, plus a margin

    if opts.replan:  # the measured runs stay; the predictions are recomputed with the current planner
        old = json.loads(Path(opts.out).read_text())
        for row in old["rows"]:
            predicted, plan = predict(row["config"], facts, profiles[row["checkpointing"]], budget, BASELINE_GUESS)
            row.update(predicted_max=predicted, plan=plan.to_dict())
        old["replanned"] = result["date"]
        result = old
        ckpts = ()
    for ckpt in ckpts:
        for name in opts.configs:
            predicted, plan = predict(name, facts, profiles[ckpt], budget, BASELINE_GUESS)
            row = {"config": name, "checkpointing": ckpt, "predicted_max": predicted, "plan": plan.to_dict()}
            if ("on" if ckpt else "off") in opts.predict_only:
                row.update(measured_max=None, first_not_fitting=None, runs=[])
            else:
                row.update(search(name, ckpt, predicted, budget, model, opts, work, need))
            result["rows"].append(row)
            Path(opts.out).write_text(json.dumps(result, indent=2) + "\n")  # partial results survive
    write_section(Path(opts.docs), markdown(result), SECTION)
    print(markdown(result))
    print(f"wrote {opts.out} and section '{SECTION}' of {opts.docs}")
    return result


if __name__ == "__main__":
    main()

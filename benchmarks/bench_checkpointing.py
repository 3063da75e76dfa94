"""Activation checkpointing under DeepSpeed, measured: peak memory per rank and step time with and without it, each
row beside the memory planner's prediction.

    python -m benchmarks.bench_checkpointing --out runs/bench/checkpointing.json --doc docs/benchmarks.md

For each model (the BlenderBot-400M shape, random-init, and SmolLM2-135M-Instruct, both fully fine-tuned in fp32)
and each ZeRO stage, one 2-rank launch of benchmarks.worker (hf-ext path, freed memory returned to the OS as in a
planned run) per variant: checkpointing off; on through ``TrainingArguments(activation_checkpointing=True)``; on
through the DeepSpeed config's top-level ``"gradient_checkpointing": true``, which DeepSpeed ignores and hf-ext turns
into the same setting (``--key_sizes`` / ``--key_configs`` say for which models and stages). The micro-batches
(``--batches``, per model) are large enough that activations, not the optimizer step's temporaries, set the peak
without checkpointing. Reported per row: the peak resident memory above the
RSS before the model existed (larger rank), the planner's prediction of that increment (its probe measures the
model's activations with checkpointing on or off), their ratio, and the median step time after ``--warmup`` steps.
The planner's largest micro-batch for ``--budget_gib`` per rank, with and without checkpointing, closes each model's
rows.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from benchmarks import harness
from benchmarks.bench_memory import RELEASE, planned_setup, planner_inputs
from benchmarks.harness import GiB
from hf_ext.deepspeed.resolve import load_deepspeed_config

MODULE = "benchmarks.bench_checkpointing"
VARIANTS = {"off": "off", "flag": "TrainingArguments flag", "ds_key": 'DeepSpeed "gradient_checkpointing" key'}


def launch(model: Path, config: str, variant: str, batch: int, opts, work: Path) -> dict:
    config_arg = config
    if variant == "ds_key":
        ds = load_deepspeed_config(config)
        ds["gradient_checkpointing"] = True
        config_arg = str(harness.write_json(Path(f"{work}_{config}_key.json"), ds))
    args = ["--model", str(model), "--config", config_arg, "--path", "hf-ext", "--batch", str(batch),
            "--seq_len", str(opts.seq_len), "--steps", str(opts.steps), *RELEASE]  # fmt: skip
    args += ["--activation_checkpointing"] * (variant == "flag")
    started = time.time()
    result = harness.launch_worker(args, Path(f"{work}_{model.name}_{config}_{variant}_b{batch}"), reuse=opts.reuse)
    if isinstance(result, str):
        raise SystemExit(f"{model.name} {config} {variant}: {result}")
    rank0 = next(r for r in result if r["rank"] == 0)
    ends = rank0["step_end_times"]
    return {
        "model": model.name, "config": config, "variant": variant, "batch": batch, "seq_len": opts.seq_len,
        "increment_bytes": max(r["increment_bytes"] for r in result),
        "peak_bytes": max(r["peak_bytes"] for r in result),
        "step_s": statistics.median(b - a for a, b in zip(ends[opts.warmup - 1 :], ends[opts.warmup :])),
        "zero_stage": rank0["zero_stage"], "wall_s": round(time.time() - started, 1),
    }  # fmt: skip


def predict(rows: list[dict], model: Path, opts) -> dict:
    """The planner's increment beside each row, and its largest micro-batch under the budget with and without."""
    from hf_ext.memory import formulas
    from hf_ext.runtime import Hardware

    device, budget = Hardware.detect().device, int(opts.budget_gib * GiB)
    inputs = {ckpt: planner_inputs(model, opts.seq_len, ckpt) for ckpt in (False, True)}
    largest = {}
    for row in rows:
        ckpt = row["variant"] != "off"
        facts, profile = inputs[ckpt]
        candidate, zero, precision = planned_setup(row["config"], model, row["batch"])
        plan = formulas.plan(candidate, facts, profile, 2, row["batch"], precision, zero=zero, device=device)
        row["planned_increment_bytes"] = plan.total_bytes
        row["planned_over_measured"] = plan.total_bytes / row["increment_bytes"]
        key = f"{row['config']}, checkpointing {'on' if ckpt else 'off'}"
        if key not in largest:
            baseline = row["peak_bytes"] - row["increment_bytes"]
            largest[key] = formulas.max_micro_batch(candidate, facts, profile, 2, budget, precision=precision,
                                                    zero=zero, baseline=baseline)  # fmt: skip
    return largest


def table(rows: list[dict]) -> str:
    header = ["model", "ZeRO", "micro-batch", "checkpointing", "peak increment GiB (larger rank)", "planner GiB", "planner ÷ measured",
              "step s", "step time vs off"]  # fmt: skip
    off = {(r["model"], r["config"]): r for r in rows if r["variant"] == "off"}
    cells = []
    for r in rows:
        base = off.get((r["model"], r["config"]))
        cells.append([
            r["model"], r["zero_stage"], f"{r['batch']} × {r['seq_len']}", VARIANTS[r["variant"]], f"{r['increment_bytes'] / GiB:.2f}",
            f"{r['planned_increment_bytes'] / GiB:.2f}", f"{r['planned_over_measured']:.2f}", f"{r['step_s']:.2f}",
            f"{r['step_s'] / base['step_s']:.2f}×" if base else "–",
        ])  # fmt: skip
    return harness.markdown_table(header, cells)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["400m", "smollm2"], help=harness.SIZE_HELP)
    parser.add_argument("--configs", nargs="+", default=["zero2", "zero3"])
    parser.add_argument("--variants", nargs="+", default=["off", "flag"], choices=list(VARIANTS))
    parser.add_argument("--key_sizes", nargs="*", default=["smollm2"], help="models also run with the DeepSpeed key")
    parser.add_argument("--key_configs", nargs="*", default=["zero2"], help="stages also run with the DeepSpeed key")
    parser.add_argument("--batches", nargs="+", type=int, default=[12, 8],
                        help="per-rank micro-batch per size, in --sizes order (large enough that activations, not the "
                        "optimizer step, set the peak)")  # fmt: skip
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="steps left out of the step time")
    parser.add_argument("--budget_gib", type=float, default=8.0, help="per-rank budget of the largest micro-batch")
    parser.add_argument("--reuse", action="store_true", help="reuse launches an interrupted run left")
    parser.add_argument("--out", default="runs/bench/checkpointing.json")
    parser.add_argument("--doc", default=None, help="write the table into this Markdown file's checkpointing section")
    opts = parser.parse_args(argv)
    out = Path(opts.out)
    work = out.with_suffix("")
    rows, largest = [], {}
    batches = dict(zip(opts.sizes, opts.batches + opts.batches[-1:] * len(opts.sizes)))
    for size in opts.sizes:
        model = harness.ensure_model(size)
        model_rows = []
        for config in opts.configs:
            key = config in opts.key_configs and size in opts.key_sizes and "ds_key" not in opts.variants
            for variant in list(opts.variants) + ["ds_key"] * key:
                model_rows.append(launch(model, config, variant, batches[size], opts, work))
                print(model_rows[-1], flush=True)
        largest[model.name] = predict(model_rows, model, opts)
        rows += model_rows
    report = {"command": harness.command(MODULE, argv), "host": harness.host_info(), "rows": rows,
              "largest_micro_batch_planned": largest, "budget_gib": opts.budget_gib}  # fmt: skip
    lines = [table(rows), ""]
    for name, by in largest.items():
        lines.append(f"- {name}, planner's largest micro-batch at {opts.budget_gib:g} GiB per rank: "
                     + "; ".join(f"{k}: {v}" for k, v in by.items()))  # fmt: skip
    text = "\n".join(lines)
    if opts.doc:
        harness.write_section(opts.doc, "checkpointing", f"`{report['command']}`\n\n{text}")
    return harness.finish(report, text, out)


if __name__ == "__main__":
    main()

"""Per-rank peak memory of DDP, ZeRO-1/2/3 and ZeRO-3 + offload at 2 ranks, stock HF path vs hf-ext path, next to
the planner's prediction; results as JSON, a table (docs/benchmarks.md, "Memory") and a PNG bar chart.

    python -m benchmarks.bench_memory --size 400m --out runs/bench_memory.json
    python -m benchmarks.bench_memory --model runs/models/medium --steps 3 --configs ddp zero2 zero3

Each configuration is one 2-rank launch of benchmarks.worker (DDP under torchrun, the others under deepspeed), run
one at a time. Before each launch the available RAM is checked against the planner's prediction for both ranks plus
a margin; a configuration that does not fit is recorded as skipped, not run.

"stock": transformers' TrainingArguments/Trainer with the preset JSON as is ("auto"s filled by transformers).
"hf-ext": hf_ext's TrainingArguments/Trainer with the same preset (config resolution, CPU thread placement, freed
memory returned to the OS, as whenever the planner plans a run). Peak RSS is measured per rank with the kernel's
high-water mark from just before the model is created to the end of training; "increment" is that peak minus the
RSS before the model existed. The prediction is the library's planner on the config hf-ext resolves for this host.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from benchmarks import harness
from benchmarks.harness import GiB

MODULE = "benchmarks.bench_memory"
CONFIGS = ("ddp", "zero1", "zero2", "zero3", "zero3_offload", "fsdp")
LABELS = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3", "zero3_offload": "ZeRO-3 + offload",
          "fsdp": "FSDP full shard"}  # fmt: skip
RELEASE = ("--release_freed_memory", "on")  # hf-ext as run for a memory budget


def planner_inputs(model_dir: Path, seq_len: int, checkpointing: bool = False):
    """The planner's model facts and activation profile (a probe of a random-init copy of the model)."""
    from hf_ext.memory.probe import from_measurement, measure

    return from_measurement(measure(str(model_dir), seq_len, checkpointing))


def planned_setup(config: str, model_dir: Path, batch: int = 1, bf16: bool = False):
    """``(candidate, zero section, precision)`` the hf-ext path runs ``config`` with on this host: the preset as
    hf-ext resolves it (bucket sizes, CPU ZeRO-3 granularity, precision), read back as the planner's candidate."""
    from hf_ext.memory import formulas

    precision = "bf16" if bf16 else "fp32"
    if config == "ddp":  # no DeepSpeed config
        return formulas.Candidate(0, ddp=True), None, precision
    if config == "fsdp":
        return formulas.FSDP_FULL_SHARD, None, precision
    import hf_ext
    from hf_ext.memory.auto import candidate_of

    args = hf_ext.TrainingArguments(output_dir=str(harness.ROOT / "runs" / "bench" / "resolve"), report_to=[],
                                    per_device_train_batch_size=batch, max_steps=10, bf16=bf16)  # fmt: skip
    resolved = hf_ext.resolve_deepspeed_config(config, args, model=model_dir, world_size=2)
    precision = next((p for p in ("bf16", "fp16") if resolved.get(p, {}).get("enabled") is True), "fp32")
    return candidate_of(resolved), resolved["zero_optimization"], precision


def predictions(model_dir: Path, opts) -> dict:
    """The planner's per-rank prediction (above the process baseline) for each configuration."""
    from hf_ext.memory import formulas
    from hf_ext.runtime import Hardware

    facts, profile = planner_inputs(model_dir, opts.seq_len)
    device = Hardware.detect().device
    plans = {}
    for name in opts.configs:
        candidate, zero, precision = planned_setup(name, model_dir, opts.batch, opts.bf16)
        plans[name] = formulas.plan(candidate, facts, profile, 2, opts.batch, precision, zero=zero, device=device)
    return {"num_params": facts.num_params, "plans": plans}


def chart(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["config"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 3.8))
    width = 0.27
    series = [("stock", "stock HF"), ("hf-ext", "hf-ext"), ("predicted", "planner (hf-ext)")]
    for i, (key, label) in enumerate(series):
        values = []
        for name in names:
            path_ = "hf-ext" if key == "predicted" else key
            row = next((r for r in rows if r["config"] == name and r["path"] == path_), None)
            if row is None or row.get("skipped"):
                values.append(0)
            elif key == "predicted":
                values.append((row["predicted_increment_bytes"] + row["baseline_bytes"]) / GiB)
            else:
                values.append(row["peak_bytes"] / GiB)
        ax.bar([x + (i - 1) * width for x in range(len(names))], values, width, label=label)
    ax.set_xticks(range(len(names)), [LABELS[n] for n in names])
    ax.set_ylabel("peak RSS per rank (GiB)")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(result: dict) -> str:
    o = result["settings"]
    precision = ", ".join(sorted(set(result["precision"].values())))
    lines = [
        f"`{o['command']}` — {result['model']} ({result['num_params']:,} parameters), 2 CPU ranks, {precision} "
        f"AdamW, micro-batch {o['batch']} x {o['seq_len']} tokens, {o['steps']} steps, {result['date']}. Peak RSS "
        "per rank (max of the two ranks) from before the model is created to the end of training; increment = peak "
        "minus the RSS before the model existed; planner = predicted increment (± band: 15% + 64 MiB).",
        "",
    ]
    header = ["config", "engine: stock / hf-ext", "stock peak GiB", "hf-ext peak GiB", "stock incr. GiB",
              "hf-ext incr. GiB", "planner incr. GiB", "planner ÷ measured (hf-ext)"]  # fmt: skip
    by = {(r["config"], r["path"]): r for r in result["rows"]}
    rows = []
    for name in dict.fromkeys(r["config"] for r in result["rows"]):
        cells = [LABELS[name]]
        s, h = by.get((name, "stock")), by.get((name, "hf-ext"))
        cells.append(" / ".join(str((r or {}).get("engine") or "—") for r in (s, h)))
        for r in (s, h):
            cells.append("skipped" if r is None or r.get("skipped") else f"{r['peak_bytes'] / GiB:.2f}")
        for r in (s, h):
            cells.append("—" if r is None or r.get("skipped") else f"{r['increment_bytes'] / GiB:.2f}")
        pred = result["predictions"].get(name)
        cells.append(f"{pred / GiB:.2f}" if pred else "—")
        ok = h is not None and not h.get("skipped") and pred
        cells.append(f"{pred / h['increment_bytes']:.2f}" if ok else "—")
        rows.append(cells)
    lines += [harness.markdown_table(header, rows), ""]
    for key, label in (("ratio_stock", "stock"), ("ratio_hf_ext", "hf-ext")):
        value = result.get(key)
        lines.append(f"- ZeRO-3 ÷ DDP peak RSS, {label}: {value:.2f}" if value else f"- ZeRO-3 ÷ DDP, {label}: n/a")
    skipped = [f"{LABELS[r['config']]} ({r['path']}): {r['skipped']}" for r in result["rows"] if r.get("skipped")]
    if skipped:
        lines.append("- not measured: " + "; ".join(skipped))
    return "\n".join(lines)


def ratio(rows, path):
    peaks = {r["config"]: r["peak_bytes"] for r in rows if r["path"] == path and not r.get("skipped")}
    return peaks["zero3"] / peaks["ddp"] if "zero3" in peaks and "ddp" in peaks else None


def report(model, pred, rows, opts, argv) -> dict:
    result = {
        "model": os.path.relpath(model, harness.ROOT) if Path(model).is_relative_to(harness.ROOT) else str(model),
        "num_params": pred["num_params"],
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "settings": {
            "batch": opts.batch,
            "seq_len": opts.seq_len,
            "steps": opts.steps,
            "bf16": opts.bf16,
            "command": harness.command(MODULE, argv),
        },
        "host": harness.host_info(),
        "predictions": {name: p.total_bytes for name, p in pred["plans"].items()},
        "precision": {name: p.precision for name, p in pred["plans"].items()},
        "plans": {name: p.to_dict() for name, p in pred["plans"].items()},
        "rows": rows,
        "ratio_stock": ratio(rows, "stock"),
        "ratio_hf_ext": ratio(rows, "hf-ext"),
    }
    harness.write_json(opts.out, result)
    chart(rows, Path(opts.png))
    harness.write_section(Path(opts.docs), opts.section, markdown(result))
    return result


def replan(model: Path, opts) -> dict:
    """The planner's column of an existing ``--out`` redone with the current planner, on the run's own settings."""
    result = json.loads(Path(opts.out).read_text())
    settings = result["settings"]
    bf16 = settings.get("bf16", "bf16" in result["precision"].values())
    configs = list(dict.fromkeys(r["config"] for r in result["rows"]))
    run = argparse.Namespace(configs=configs, batch=settings["batch"], seq_len=settings["seq_len"], bf16=bf16)
    pred = predictions(model, run)
    result["predictions"] = {name: p.total_bytes for name, p in pred["plans"].items()}
    result["plans"] = {name: p.to_dict() for name, p in pred["plans"].items()}
    for row in result["rows"]:
        row["predicted_increment_bytes"] = pred["plans"][row["config"]].total_bytes
    result["replanned"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    harness.write_json(opts.out, result)
    print(markdown(result))
    print(f"replanned {opts.out}")
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="400m", help=harness.SIZE_HELP)
    parser.add_argument("--model", default=None, help="model directory (default: runs/models/<size>)")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--paths", nargs="+", default=["stock", "hf-ext"], choices=["stock", "hf-ext"])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision (fp32 master weights)")
    parser.add_argument("--from_config", action="store_true",
                        help="--model holds a config only: each run pre-trains a random-init model (GPT-2 from scratch)")  # fmt: skip
    parser.add_argument("--seq_len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--margin_gib", type=float, default=1.0, help="free RAM kept beyond the two ranks' needs")
    parser.add_argument("--out", default="runs/bench_memory.json")
    parser.add_argument("--docs", default=str(harness.DOCS), help="markdown file whose marked section is rewritten")
    parser.add_argument("--section", default="bench_memory", help="the section's marker name in --docs")
    parser.add_argument("--png", default="docs/memory.png")
    parser.add_argument("--replan", action="store_true",
                        help="only redo the planner's column of an existing --out (the measured rows stay)")  # fmt: skip
    parser.add_argument("--reuse", action="store_true",
                        help="read back the launches an earlier run of the same command left beside --out")  # fmt: skip
    opts = parser.parse_args(argv)

    model = harness.ensure_model(opts.size, opts.model)
    opts.from_config = opts.from_config or not harness.has_weights(model)  # a config-only model (CLASSIFIERS)
    if opts.replan:
        return replan(model, opts)
    pred = predictions(model, opts)
    work = Path(opts.out).with_suffix("")
    work.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in opts.configs:
        plan = pred["plans"][name]
        for path in opts.paths:
            need = 2 * (plan.total_bytes + 600 * 2**20) + int(opts.margin_gib * GiB)  # two ranks + baselines
            free = harness.available_memory()
            row = {"config": name, "path": path, "predicted_increment_bytes": plan.total_bytes, "band": plan.band}
            out = Path(f"{work}_{name}_{path}")
            if free < need and not (opts.reuse and harness.finished_launch(out)):
                row["skipped"] = f"{free / GiB:.1f} GiB available, {need / GiB:.1f} GiB needed"
                print(f"{name} ({path}): skipped, {row['skipped']}", flush=True)
                rows.append(row)
                continue
            started = time.time()
            args = ["--model", str(model), "--config", name, "--path", path, "--batch", str(opts.batch)]
            args += ["--seq_len", str(opts.seq_len), "--steps", str(opts.steps), *RELEASE, *["--bf16"] * opts.bf16]
            args += ["--from_config"] * opts.from_config
            launcher = "torchrun" if name in ("ddp", "fsdp") else "deepspeed"
            result = harness.launch_worker(args, out, launcher=launcher, reuse=opts.reuse)
            if isinstance(result, str):
                row["skipped"] = result
            else:
                worst = max(result, key=lambda r: r["peak_bytes"])
                keys = ("peak_bytes", "baseline_bytes", "increment_bytes", "zero_stage", "engine")
                row.update({k: worst.get(k) for k in keys})
                row["ranks"] = [{k: r[k] for k in ("peak_bytes", "baseline_bytes", "increment_bytes")} for r in result]
            row["seconds"] = round(time.time() - started, 1)
            print(json.dumps({k: v for k, v in row.items() if k != "ranks"}), flush=True)
            rows.append(row)
            report(model, pred, rows, opts, argv)  # partial results survive an interrupted run
    result = report(model, pred, rows, opts, argv)
    print(markdown(result))
    print(f"wrote {opts.out}, {opts.png}, section '{opts.section}' of {opts.docs}")
    return result


if __name__ == "__main__":
    main()

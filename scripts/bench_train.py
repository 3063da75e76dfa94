"""Training throughput of hf_ext.Trainer vs the stock transformers.Trainer: the extension must cost nothing.

    python scripts/bench_train.py --sizes tiny 400m --configs zero2 zero3 --steps 60 12 --repeats 4 --interleave \
        --out runs/bench/train_interleaved_r4.json
    python scripts/bench_train.py --sizes tiny 400m --configs zero2 zero3 --steps 60 10 --repeats 3 --threads 1 \
        --out runs/bench/train.json

For each model shape and ZeRO preset, stock and hf-ext train the same model on the same synthetic data with the same
DeepSpeed config, on 2 ranks (`deepspeed --num_gpus 2 scripts/memory_worker.py`), alternating stock / hf-ext launch
by launch (``--repeats`` pairs) so that background load hits both alike. Both paths get the preset's JSON file:
stock hands it to transformers, which fills its "auto"s; hf-ext resolves it (tests/test_deepspeed_config.py checks
the resolved values are identical). ``--threads N`` gives both paths N torch threads per rank, which measures the
extension's own cost; without it each path places threads its own way (hf-ext: cores ÷ local ranks, stock:
accelerate's default), which is measured by scripts/bench_launchers.py. ``--release_freed_memory`` is passed to
hf-ext's TrainingArguments (by default off in these runs: it is on only when the memory planner plans the run).

``--interleave`` runs each size and config as ONE launch of scripts/throughput_worker.py in which the two paths take
turns (stock, hf-ext, hf-ext, stock, …; ``2 × --repeats`` segments of ``--steps`` steps). Each segment builds its own
TrainingArguments, model, Trainer and engine and drops them after. Pairs of adjacent segments are a minute or two
apart instead of a launch apart, and share the launch's process placement. On the 2-core test host this did not
narrow the 400M interval much: its speed drifts within a minute (docs/benchmarks.md, "Training throughput"), which
is why the worker's ``--trace`` also counts what runs in a step.
Both paths then share one thread count (``--threads``, by default hf-ext's rule: cores ÷ local ranks).

Reported per launch, from rank 0: steady-state samples/s (global batch × steps ÷ time from the end of step
``--warmup`` to the end of the last step: engine start-up and the first steps excluded), the time to build
TrainingArguments (hf-ext's DeepSpeed config resolution happens there), the engine start-up time (from ``train()``
to the first step), and the system CPU seconds and page faults per step. The summary is the median over repeats and
the ratio hf-ext ÷ stock (target ≥ 0.98), with the time of hf-ext's config resolution alone (in process).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]

from bench_memory import launch, launch_worker  # noqa: E402  (the same 2-rank launcher as the memory benchmark)

from hf_ext.deepspeed.resolve import load_deepspeed_config  # noqa: E402
from hf_ext.runtime import usable_cores  # noqa: E402  (hf-ext's own thread rule: cores ÷ local ranks)

SECTION = "## Training throughput"
INTERLEAVED_WORKER = ROOT / "scripts" / "throughput_worker.py"


def steady_samples_per_second(rank0: dict, warmup: int) -> float:
    ends = rank0["step_end_times"]
    if len(ends) <= warmup:
        raise SystemExit(f"need more than --warmup {warmup} steps, got {len(ends)}")
    return rank0["global_batch"] * (len(ends) - warmup) / (ends[-1] - ends[warmup - 1])


def per_step_usage(rank0: dict, warmup: int) -> dict:
    """Mean CPU seconds (user, system) and minor page faults per measured step, for telling where time went."""
    usage = rank0["step_usage"][warmup:]  # [0] is train begin: usage[k] is after step k
    steps = len(usage) - 1
    return {
        name: (usage[-1][i] - usage[0][i]) / steps
        for i, name in enumerate(("user_s_per_step", "system_s_per_step", "page_faults_per_step"))
    }


def measured_row(size: str, config: str, path: str, repeat: int, rank0: dict, parameters: int, args) -> dict:
    """One training run (a launch, or a segment of an interleaved launch) as a row of the report."""
    return {
        "size": size, "config": config, "path": path, "repeat": repeat, "parameters": parameters,
        "samples_per_s": steady_samples_per_second(rank0, args.warmup), "global_batch": rank0["global_batch"],
        "args_s": rank0["args_seconds"], "engine_start_s": rank0["engine_start_seconds"],
        "final_loss": rank0["final_loss"], "zero_stage": rank0["zero_stage"], **per_step_usage(rank0, args.warmup),
    }  # fmt: skip


def ensure_model(size: str) -> Path:
    model = ROOT / "runs" / "models" / size
    if not (model / "config.json").exists():
        from chat_e.models import build

        build(str(model), size, seed=0)
    return model


def sum_parameters(model_dir: Path) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    with torch.device("meta"):
        model = AutoModelForSeq2SeqLM.from_config(AutoConfig.from_pretrained(model_dir))
    return sum(p.numel() for p in model.parameters())


def resolution_ms(model_dir: Path, config: str, repeats: int = 20) -> dict:
    """Time of hf-ext's whole config resolution (load, normalize, fill, validate), in process, in milliseconds."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    import hf_ext

    args = hf_ext.TrainingArguments(output_dir=str(ROOT / "runs" / "bench" / "resolve"), report_to=[], max_steps=10)
    model = SimpleNamespace(config=AutoConfig.from_pretrained(model_dir))
    times = []
    for _ in range(repeats + 1):  # the first call imports DeepSpeed's config models
        started = time.perf_counter()
        hf_ext.explain_deepspeed_config(config, args, model=model, world_size=2)
        times.append(1000 * (time.perf_counter() - started))
    return {"first_ms": times[0], "median_ms": statistics.median(times[1:]), "max_ms": max(times[1:])}


# Student's t, two-sided 95%, by degrees of freedom (1.96 past the table)
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 11: 2.20, 12: 2.18,
       13: 2.16, 14: 2.14, 15: 2.13, 16: 2.12, 17: 2.11, 18: 2.10, 19: 2.09, 20: 2.09, 25: 2.06, 30: 2.04}  # fmt: skip


def geometric_mean_interval(ratios: list[float]) -> tuple[float, float, float]:
    """Geometric mean of per-pair ratios and its 95% interval (t interval on the log ratios)."""
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), float("nan"), float("nan")
    df = len(logs) - 1
    t = T95[max(k for k in T95 if k <= df)] if df <= 30 else 1.96  # the next smaller table entry: a wider interval
    half = t * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for key in dict.fromkeys((r["size"], r["config"]) for r in rows):
        group = {
            p: [r for r in rows if (r["size"], r["config"]) == key and r["path"] == p] for p in ("stock", "hf-ext")
        }
        if not group["stock"] or not group["hf-ext"]:
            continue
        metrics = ("samples_per_s", "args_s", "engine_start_s", "system_s_per_step", "page_faults_per_step")
        med = {p: {m: statistics.median(r[m] for r in g) for m in metrics} for p, g in group.items()}
        out.append({
            "size": key[0], "config": key[1], "parameters": group["stock"][0]["parameters"],
            "stock": med["stock"], "hf-ext": med["hf-ext"],
            "ratio": med["hf-ext"]["samples_per_s"] / med["stock"]["samples_per_s"],
            "per_launch_ratios": [h["samples_per_s"] / s["samples_per_s"]
                                  for s, h in zip(group["stock"], group["hf-ext"])],
        })  # fmt: skip
        out[-1]["pairs_of"] = "segments" if "segment" in group["stock"][0] else "launches"
        out[-1]["geomean_ratio"], *out[-1]["ratio_ci95"] = geometric_mean_interval(out[-1]["per_launch_ratios"])
        hooks = [r["hf_ext_hook_us_per_step"] for r in group["hf-ext"] if "hf_ext_hook_us_per_step" in r]
        if hooks:  # hf-ext's own callbacks, per step, and their share of a step (at hf-ext's median throughput)
            step_us = 1e6 * group["hf-ext"][0]["global_batch"] / med["hf-ext"]["samples_per_s"]
            out[-1]["hf_ext_hook_us_per_step"] = statistics.median(hooks)
            out[-1]["hf_ext_hook_share_of_step"] = statistics.median(hooks) / step_us
    return out


def table(summary: list[dict]) -> str:
    lines = [
        "| model | config | pairs of | stock samples/s | hf-ext samples/s | hf-ext ÷ stock | per-pair ratios "
        "| geometric mean (95% interval) "
        "| TrainingArguments s (stock / hf-ext) | engine start s (stock / hf-ext) | hf-ext resolution ms "
        "| system s / step (stock / hf-ext) | page faults / step (stock / hf-ext) "
        "| hf-ext callbacks µs / step (share of a step) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        hooks = "–"  # timed in interleaved runs only
        if "hf_ext_hook_us_per_step" in s:
            hooks = f"{s['hf_ext_hook_us_per_step']:.0f} ({s['hf_ext_hook_share_of_step']:.1e})"
        lines.append(
            f"| {s['size']} ({s['parameters'] / 1e6:.1f}M) | {s['config']} | {s['pairs_of']} "
            f"| {s['stock']['samples_per_s']:.2f} "
            f"| {s['hf-ext']['samples_per_s']:.2f} | **{s['ratio']:.3f}** "
            f"| {', '.join(f'{r:.3f}' for r in s['per_launch_ratios'])} "
            f"| {s['geomean_ratio']:.3f} ({s['ratio_ci95'][0]:.3f}–{s['ratio_ci95'][1]:.3f}) "
            f"| {s['stock']['args_s']:.2f} / {s['hf-ext']['args_s']:.2f} "
            f"| {s['stock']['engine_start_s']:.1f} / {s['hf-ext']['engine_start_s']:.1f} "
            f"| {s['resolution']['median_ms']:.1f} "
            f"| {s['stock']['system_s_per_step']:.2f} / {s['hf-ext']['system_s_per_step']:.2f} "
            f"| {s['stock']['page_faults_per_step']:,.0f} / {s['hf-ext']['page_faults_per_step']:,.0f} "
            f"| {hooks} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["tiny", "400m"])
    parser.add_argument("--configs", nargs="+", default=["zero2", "zero3"])
    parser.add_argument("--batch", type=int, default=4, help="per-device micro-batch")
    parser.add_argument("--seq_len", type=int, default=32)
    parser.add_argument("--steps", nargs="+", type=int, default=[60, 8], help="steps per size, in --sizes order")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the throughput")
    parser.add_argument("--repeats", type=int, default=2, help="stock / hf-ext launch pairs per size and config")
    parser.add_argument(
        "--threads", type=int, default=None,
        help="OMP_NUM_THREADS for both paths (the extension's own cost, without hf-ext's thread placement)",
    )  # fmt: skip
    parser.add_argument(
        "--release_freed_memory", default="auto", choices=["auto", "on", "off"],
        help="hf-ext's TrainingArguments.release_freed_memory (auto, the default: off here, no plan is made)",
    )  # fmt: skip
    parser.add_argument(
        "--interleave", action="store_true",
        help="one launch per size and config, stock and hf-ext taking turns inside it (2 × --repeats segments)",
    )  # fmt: skip
    parser.add_argument("--out", default="runs/bench/train.json")
    args = parser.parse_args(argv)
    if args.interleave and not args.threads:
        args.threads = max(1, usable_cores() // 2)  # one process runs both paths: one thread count, hf-ext's rule
    if args.interleave and args.release_freed_memory == "on":
        parser.error("--interleave runs stock in the same processes: glibc's release setting would apply to it too")
    env_extra = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else None
    steps = dict(zip(args.sizes, args.steps + args.steps[-1:] * len(args.sizes)))

    out = Path(args.out)
    work = out.with_suffix("")
    work.parent.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    rows = []
    for size in args.sizes:
        model = ensure_model(size)
        parameters = sum_parameters(model)
        opts = SimpleNamespace(batch=args.batch, seq_len=args.seq_len, steps=steps[size])
        for config in args.configs:
            # both paths get the preset's JSON file: the same config (hf-ext adapts presets given by name to the host)
            config_file = work.parent / f"{work.name}_{config}.json"
            config_file.write_text(json.dumps(load_deepspeed_config(config), indent=1))
            if args.interleave:  # one launch, the paths taking turns segment by segment
                started = time.time()
                out_base = Path(f"{work}_{size}_{config}_interleaved")
                result = launch_worker(
                    INTERLEAVED_WORKER,
                    ["--model", str(model), "--config", str(config_file), "--out", str(out_base),
                     "--batch", str(args.batch), "--seq_len", str(args.seq_len), "--steps", str(steps[size]),
                     "--segments", str(2 * args.repeats)],
                    out_base, env_extra,
                )  # fmt: skip
                if isinstance(result, str):
                    raise SystemExit(f"{size} {config} interleaved: {result}")
                wall = round(time.time() - started, 1)
                for seg in next(r for r in result if r["rank"] == 0)["segments"]:
                    rows.append(measured_row(size, config, seg["path"], seg["segment"] // 2, seg, parameters, args))
                    rows[-1].update(
                        segment=seg["segment"],
                        launch_wall_s=wall,
                        rss_after_bytes=seg["rss_after_bytes"],
                        hf_ext_hook_us_per_step=1e6 * seg["hf_ext_hook_seconds_per_step"],
                    )
                    print(json.dumps(rows[-1]), flush=True)
                continue
            for repeat in range(args.repeats):
                for path in ("stock", "hf-ext") if repeat % 2 == 0 else ("hf-ext", "stock"):
                    started = time.time()
                    result = launch(
                        model, str(config_file), path, opts, Path(f"{work}_{size}_{config}_{path}_{repeat}"),
                        ("--release_freed_memory", args.release_freed_memory), env_extra,
                    )  # fmt: skip
                    if isinstance(result, str):
                        raise SystemExit(f"{size} {config} {path}: {result}")
                    rank0 = next(r for r in result if r["rank"] == 0)
                    row = measured_row(size, config, path, repeat, rank0, parameters, args)
                    row.update(
                        wall_s=round(time.time() - started, 1),
                        released_freed_memory=rank0.get("released_freed_memory"),
                    )
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    summary = summarize(rows)
    for entry in summary:
        entry["resolution"] = resolution_ms(ensure_model(entry["size"]), entry["config"])
    report = {
        "command": "python scripts/bench_train.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "batch": args.batch, "seq_len": args.seq_len, "steps": steps, "warmup": args.warmup,
        "repeats": args.repeats, "interleaved": args.interleave, "world_size": 2, "release_freed_memory": args.release_freed_memory,
        "torch_threads_per_rank": args.threads or {"hf-ext": max(1, usable_cores() // 2), "stock": "accelerate's default"},
        "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "rows": rows, "summary": summary,
    }  # fmt: skip
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(table(summary))
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
